// The jaxserve dashboard: polls GET /v1/engine/state four times a second and draws what the
// engine is doing: its slots, its KV page pool, its waiting queue and, from the steps it ran,
// charts of the last minutes. Each poll asks only for the steps after the last one it has seen
// (`since`), so the charts keep every step while each answer stays small.

import { AuthError, askKey, authRequired, getJSON, hasKey } from "./api.js";
import { drawChart, legend } from "./charts.js";
import { CACHED, FREE, PAGE_COLORS, PagePool, SHARED, slotColor } from "./pool.js";
import { PromptForm } from "./prompt.js";
import { SlotGrid, renderQueue } from "./slots.js";

const POLL_MS = 250;
const KEEP_S = 600;  // the longest chart window
const RATE_S = 5;  // steps/s and tokens/s over this many seconds
const COLORS = { used: "#1c7ed6", cached: "#94a3b8", running: "#2b8a3e", waiting: "#f08c00",
                 decode: "#1c7ed6", prefill: "#f08c00" };
const $ = (id) => document.getElementById(id);

const samples = [];  // one per poll: {t, running, waiting, used, cached} (percent of pages)
const steps = [];  // one per engine step: {t, tokens, decode}
let lastStep = null;
let clockOffset = 0;  // server time minus this browser's, in ms
let budget;

const grid = new SlotGrid($("slots"));
const pool = new PagePool($("pool"), $("page-info"));
const form = new PromptForm();

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

function setConnection(state, text) {
  const el = $("connection");
  el.dataset.state = state;
  el.textContent = text;
}

async function poll() {
  // the first poll asks for all the steps the engine keeps (since=0), to start the charts with them
  const state = await getJSON(`v1/engine/state?since=${lastStep ?? 0}`);
  const now = state.time * 1000;
  clockOffset = now - Date.now();
  if (lastStep !== null && state.step < lastStep) steps.length = 0;  // another engine: steps restart
  const pages = state.pages;
  const percent = (n) => (pages.total ? (100 * n) / pages.total : 0);
  for (const h of state.history) {
    if (lastStep !== null && h.step <= lastStep) continue;
    steps.push({ t: h.time * 1000, tokens: h.tokens, decode: h.decode_rows });
    if (lastStep === null) {
      samples.push({ t: h.time * 1000, running: h.running, waiting: h.waiting, used: percent(h.used_pages),
                     cached: percent(h.used_pages + h.cached_pages) });
    }
  }
  lastStep = state.step;
  samples.push({ t: now, running: state.num_running, waiting: state.num_waiting,
                 used: percent(pages.used), cached: percent(pages.used + pages.cached) });
  while (samples.length && samples[0].t < now - KEEP_S * 1000) samples.shift();
  while (steps.length && steps[0].t < now - KEEP_S * 1000) steps.shift();
  budget = state.token_budget;
  $("budget").textContent = `(budget ${budget})`;
  render(state, now);
}

function render(state, now) {
  $("strategy").textContent = `strategy ${state.strategy}`;
  $("step").textContent = state.step;
  const recent = steps.filter((s) => s.t >= now - RATE_S * 1000);
  $("steps-per-s").textContent = (recent.length / RATE_S).toFixed(1);
  $("tokens-per-s").textContent = (recent.reduce((n, s) => n + s.tokens, 0) / RATE_S).toFixed(0);
  $("compiles").textContent = state.stats.num_compiles ?? 0;
  $("preemptions").textContent = state.stats.num_preemptions ?? 0;
  const drafted = state.stats.spec_decode_num_draft_tokens ?? 0;
  const kept = state.stats.spec_decode_num_accepted_tokens ?? 0;
  $("drafts-kept").textContent = drafted ? `${kept} / ${drafted} (${((100 * kept) / drafted).toFixed(0)}%)` : "none";

  grid.update(state.slots, form.mine);
  const busy = state.slots.filter((s) => s.phase !== "free");
  const prefill = busy.filter((s) => s.phase === "prefill").length;
  $("slots-summary").textContent =
    `${busy.length} of ${state.max_slots} busy · ${prefill} prefill · ${busy.length - prefill} decode · ` +
    `budget ${state.token_budget} tokens/step`;

  const pages = state.pages;
  pool.update(pages, state.slots);
  for (const name of ["used", "cached", "shared", "free", "total"]) $(`pages-${name}`).textContent = pages[name];
  // Per KV-cache group: a sliding-window group keeps only its window, the full group every page.
  $("pages-groups").textContent = (pages.groups ?? []).map((g, i) =>
    `group ${i} (${g.window === null ? "full attention" : `window ${g.window}`}): used ${g.used} · cached ${g.cached}`,
  ).join("  |  ");
  $("pages-summary").textContent = `${pages.total} pages of ${pages.page_size} tokens · ` +
    `${((100 * pages.used) / Math.max(1, pages.total)).toFixed(1)}% used` +
    (pages.cell > 1 ? ` · a square per ${pages.cell} pages` : "");

  $("queue-summary").textContent = `${state.num_waiting} waiting`;
  renderQueue($("queue"), state.waiting, state.num_waiting);
  drawCharts(now);
}

function drawCharts(now) {
  const seconds = Number($("window").value);
  const series = (key, color, kind, from = samples) => ({ color, kind, points: from.map((s) => [s.t, s[key]]) });
  drawChart($("chart-kv"), [series("cached", COLORS.cached, "area"), series("used", COLORS.used, "area")],
            { now, window: seconds, yMax: 100, unit: "%" });
  drawChart($("chart-requests"), [series("waiting", COLORS.waiting, "line"), series("running", COLORS.running, "line")],
            { now, window: seconds });
  drawChart($("chart-tokens"), [series("tokens", COLORS.prefill, "bars", steps), series("decode", COLORS.decode, "bars", steps)],
            { now, window: seconds, hline: budget });
}

function legends() {
  legend($("legend-kv"), [["used by running requests", COLORS.used], ["+ cached (prefix cache)", COLORS.cached]]);
  legend($("legend-requests"), [["running", COLORS.running], ["waiting", COLORS.waiting]]);
  legend($("legend-tokens"), [["decode rows", COLORS.decode], ["prompt tokens", COLORS.prefill],
                              ["budget (dashed, when in scale)", "#868e96"]]);
  legend($("pool-legend"), [["a slot's pages (its colour)", slotColor(0)], ["shared", PAGE_COLORS[SHARED]],
                            ["cached", PAGE_COLORS[CACHED]], ["free", PAGE_COLORS[FREE]]]);
}

async function describeModel() {
  const models = await getJSON("v1/models");
  const card = models.data[0];
  $("model").textContent = `${card.id} · context ${card.max_model_len}`;
  $("template-note").textContent = card.chat_template === "model"
    ? "(completions; the model also has a chat template)"
    : `(completions: chat template ${card.chat_template ?? "none"}, likely a base model)`;
}

async function main() {
  legends();
  if (authRequired && !hasKey()) await askKey("This server wants an API key (its --api-key).");
  let described = false;
  for (;;) {
    const started = performance.now();
    try {
      if (!described) { await describeModel(); described = true; }
      await poll();
      setConnection("live", "live");
    } catch (error) {
      if (error instanceof AuthError) {
        setConnection("error", "API key refused");
        await askKey(`${error.message}. Enter the key again.`);
        continue;
      }
      setConnection("error", `no answer: ${error.message}`);
      await sleep(1000);
    }
    await sleep(Math.max(0, POLL_MS - (performance.now() - started)));
  }
}

$("window").addEventListener("change", () => drawCharts(Date.now() + clockOffset));
main();
