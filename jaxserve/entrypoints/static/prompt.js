// The prompt form: sends one prompt to /v1/completions (the default model is a base model, so
// completions, not chat) with `stream: true`, and appends the answer as its SSE chunks arrive.
// Its request id lets the slot grid outline the slot that serves it.

import { errorMessage, headers } from "./api.js";

export class PromptForm {
  constructor() {
    this.form = document.getElementById("prompt-form");
    this.send = document.getElementById("send");
    this.stopButton = document.getElementById("stop");
    this.status = document.getElementById("prompt-status");
    this.answer = document.getElementById("answer");
    this.requestId = null;  // the completion's id: its engine requests' ids start with it
    this.controller = null;
    this.form.addEventListener("submit", (event) => { event.preventDefault(); this.run(); });
    this.stopButton.addEventListener("click", () => this.controller?.abort());
  }

  // The prefix of the engine request ids serving the current prompt, or null.
  get mine() {
    return this.requestId ? `${this.requestId}-` : null;
  }

  async run() {
    const prompt = document.getElementById("prompt").value;
    const body = {
      prompt, stream: true,
      max_tokens: Number(document.getElementById("max-tokens").value) || 16,
      temperature: Number(document.getElementById("temperature").value) || 0,
    };
    this.controller = new AbortController();
    this.send.disabled = true;
    this.stopButton.disabled = false;
    this.requestId = null;
    const shown = document.createElement("span");
    shown.className = "prompt-text";
    shown.textContent = prompt;
    this.answer.replaceChildren(shown);
    this.status.textContent = "sent…";
    let tokens = 0, finish = null;
    try {
      const response = await fetch("v1/completions", {
        method: "POST", body: JSON.stringify(body), signal: this.controller.signal,
        headers: headers({ "Content-Type": "application/json" }),
      });
      if (!response.ok) throw new Error(await errorMessage(response));
      for await (const chunk of events(response)) {
        if (chunk.error) throw new Error(chunk.error.message);
        this.requestId = chunk.id;
        const choice = chunk.choices?.[0];
        if (!choice) continue;
        if (choice.text) this.answer.append(choice.text);
        tokens += 1;
        finish = choice.finish_reason ?? finish;
        this.status.textContent = `${chunk.id}: streaming (${tokens} chunks)`;
        this.answer.scrollTop = this.answer.scrollHeight;
      }
      this.status.textContent = `${this.requestId ?? "request"}: finished (${finish ?? "?"})`;
    } catch (error) {
      this.status.textContent = error.name === "AbortError" ? "stopped" : `error: ${error.message}`;
    } finally {
      this.send.disabled = false;
      this.stopButton.disabled = true;
      this.controller = null;
      setTimeout(() => { if (!this.controller) this.requestId = null; }, 2000);
    }
  }
}

// The JSON chunks of a server-sent-events response, until `data: [DONE]`.
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}
