// The slot grid (one card per slot: its request, phase and tokens) and the waiting queue.

import { slotColor } from "./pool.js";

const QUEUE_SHOWN = 100;

// A request id short enough for a card: the start and the end (the choice index).
export function shortId(id) {
  return id.length > 22 ? `${id.slice(0, 11)}…${id.slice(-8)}` : id;
}

function element(tag, className, parent) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (parent) parent.append(el);
  return el;
}

export class SlotGrid {
  constructor(container) {
    this.container = container;
    this.cards = [];
  }

  // Builds the cards once the number of slots is known.
  resize(count) {
    if (this.cards.length === count) return;
    this.container.replaceChildren();
    this.cards = Array.from({ length: count }, (_, slot) => {
      const card = element("div", "slot", this.container);
      card.dataset.slot = slot;
      card.style.borderLeftColor = slotColor(slot);
      const head = element("div", "slot-head", card);
      element("span", "slot-num", head).textContent = `slot ${slot}`;
      const phase = element("span", "phase", head);
      const request = element("div", "slot-req", card);
      const bar = element("div", "bar", card);
      const prompt = element("div", "bar-prompt", bar), output = element("div", "bar-output", bar);
      const nums = element("div", "slot-nums", card);
      return { card, phase, request, prompt, output, nums };
    });
  }

  // slots: /v1/engine/state's `slots`; mine: the id prefix of the prompt form's request, if any.
  update(slots, mine) {
    this.resize(slots.length);
    slots.forEach((s, i) => {
      const c = this.cards[i];
      c.card.dataset.phase = s.phase;
      c.card.classList.toggle("mine", Boolean(mine && s.request_id?.startsWith(mine)));
      c.phase.textContent = s.phase;
      c.request.textContent = s.request_id ? shortId(s.request_id) : "—";
      c.request.title = s.request_id ?? "";
      // the bar: computed prompt tokens, then output tokens against the longest possible sequence
      const total = Math.max(1, s.num_prompt_tokens + s.max_tokens);
      c.prompt.style.width = `${(100 * Math.min(s.num_computed_tokens, s.num_prompt_tokens)) / total}%`;
      c.output.style.width = `${(100 * s.num_output_tokens) / total}%`;
      c.nums.textContent = s.request_id
        ? `${s.num_computed_tokens}/${s.num_tokens} tok · out ${s.num_output_tokens}/${s.max_tokens} · ${s.pages} pg`
        : "";
    });
  }
}

export function renderQueue(list, waiting, total) {
  const items = waiting.slice(0, QUEUE_SHOWN).map((w) => {
    const li = document.createElement("li");
    li.textContent = `${shortId(w.request_id)} · ${w.num_tokens} tok · ${w.wait_s.toFixed(1)} s`;
    li.title = w.request_id;
    return li;
  });
  if (total > items.length) {
    const more = document.createElement("li");
    more.className = "more";
    more.textContent = `and ${total - items.length} more`;
    items.push(more);
  }
  list.replaceChildren(...items);
}
