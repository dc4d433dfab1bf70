// The KV page pool on a canvas: one square per page (page 0, the null page, left out), coloured
// by the slot that reads it, or as free, cached (kept for the prefix cache) or shared (read by
// several sequences). Owners come run-length encoded from /v1/engine/state: [[owner, count], ...];
// past 4096 pages one square stands for a cell of `pages.cell` pages, coloured as its busiest.

export const FREE = -1, CACHED = -2, SHARED = -3;
export const PAGE_COLORS = { [FREE]: "#e9ecef", [CACHED]: "#94a3b8", [SHARED]: "#212529" };
const OWNER_NAMES = { [FREE]: "free", [CACHED]: "cached (prefix cache, no reader)", [SHARED]: "shared by several slots" };
const MAX_HEIGHT = 260;  // CSS pixels: a large pool gets smaller squares, not a taller canvas

// The colour of a slot, and of its pages: hues spread by the golden angle, so neighbours differ.
export function slotColor(slot) {
  return `hsl(${Math.round((slot * 137.508) % 360)} 68% 50%)`;
}

export class PagePool {
  constructor(canvas, info) {
    this.canvas = canvas;
    this.info = info;
    this.owners = new Int32Array(0);
    this.cell = 1;  // pages per square
    this.key = "";
    this.size = 8;  // CSS pixels per square
    this.columns = 1;
    this.slots = [];
    canvas.addEventListener("mousemove", (event) => this.describe(event));
    canvas.addEventListener("mouseleave", () => { this.info.textContent = "\u00a0"; });
  }

  // Redraws when the owners or the canvas width changed.
  update(pages, slots) {
    this.slots = slots;
    const width = this.canvas.clientWidth;
    const key = `${width}:${JSON.stringify(pages.owners)}`;
    if (key === this.key) return;
    this.key = key;
    this.cell = pages.cell;
    this.owners = new Int32Array(Math.ceil(pages.total / pages.cell));
    let i = 0;
    for (const [owner, count] of pages.owners) { this.owners.fill(owner, i, i + count); i += count; }
    this.draw(width);
  }

  draw(width) {
    const n = this.owners.length;
    this.size = Math.max(2, Math.min(14, Math.floor(Math.sqrt((width * MAX_HEIGHT) / Math.max(n, 1)))));
    while (this.size > 2 && Math.ceil(n / Math.floor(width / this.size)) * this.size > MAX_HEIGHT) this.size--;
    this.columns = Math.max(1, Math.floor(width / this.size));
    const height = Math.max(this.size, Math.ceil(n / this.columns) * this.size);
    const ratio = window.devicePixelRatio || 1;
    this.canvas.style.height = `${height}px`;
    this.canvas.width = Math.round(width * ratio);
    this.canvas.height = Math.round(height * ratio);
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    const gap = this.size >= 6 ? 1 : 0;
    let color = null;
    for (let p = 0; p < n; p++) {
      const owner = this.owners[p];
      const c = owner >= 0 ? slotColor(owner) : PAGE_COLORS[owner];
      if (c !== color) { ctx.fillStyle = c; color = c; }
      ctx.fillRect((p % this.columns) * this.size, Math.floor(p / this.columns) * this.size,
                   this.size - gap, this.size - gap);
    }
  }

  describe(event) {
    const rect = this.canvas.getBoundingClientRect();
    const i = Math.floor((event.clientY - rect.top) / this.size) * this.columns
      + Math.floor((event.clientX - rect.left) / this.size);
    if (i < 0 || i >= this.owners.length) return;
    const owner = this.owners[i];
    const who = owner >= 0 ? `slot ${owner}: ${this.slots[owner]?.request_id ?? "?"}` : OWNER_NAMES[owner];
    const pages = this.cell === 1 ? `page ${i + 1}` : `pages ${i * this.cell + 1}–${(i + 1) * this.cell}`;
    this.info.textContent = `${pages}: ${who}`;
  }
}
