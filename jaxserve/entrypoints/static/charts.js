// Time-series charts on a canvas: the last `window` seconds, newest on the right. A series is
// drawn as a line, a filled area, or one bar per point (steps: idle time stays empty).

const MARGIN = { left: 44, right: 8, top: 8, bottom: 20 };

// Fits the canvas's pixels to its CSS size; returns its 2D context in CSS pixels.
function context(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  return { ctx, width, height };
}

// A round upper bound for the y axis.
function niceMax(value) {
  if (value <= 1) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  return [1, 2, 2.5, 5, 10].map((m) => m * power).find((v) => v >= value);
}

// series: [{label, color, points: [[timeMs, value], ...], kind: "line" | "area" | "bars"}], drawn in order.
// Options: now (ms), window (s), yMax (fixed) or yMin (at least), hline (a dashed level, e.g. the token
// budget, drawn when the scale reaches it).
export function drawChart(canvas, series, { now, window: seconds, yMax, yMin = 1, hline, unit = "" }) {
  const { ctx, width, height } = context(canvas);
  const plotW = width - MARGIN.left - MARGIN.right, plotH = height - MARGIN.top - MARGIN.bottom;
  const start = now - seconds * 1000;
  let top = yMax;
  if (top === undefined) {
    let highest = yMin;
    for (const s of series) for (const [t, v] of s.points) if (t >= start && v > highest) highest = v;
    top = niceMax(highest * 1.05);
  }
  const x = (t) => MARGIN.left + ((t - start) / (seconds * 1000)) * plotW;
  const y = (v) => MARGIN.top + plotH - (Math.min(v, top) / top) * plotH;

  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#6b7480";
  ctx.strokeStyle = "#e5e8eb";
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (const f of [0, 0.5, 1]) {
    const yy = Math.round(y(top * f)) + 0.5;
    ctx.beginPath(); ctx.moveTo(MARGIN.left, yy); ctx.lineTo(width - MARGIN.right, yy); ctx.stroke();
    ctx.fillText(`${+(top * f).toFixed(1)}${unit}`, MARGIN.left - 4, yy);
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  const tick = seconds <= 120 ? 15 : seconds <= 300 ? 60 : 120;
  for (let ago = 0; ago <= seconds; ago += tick) {
    const xx = x(now - ago * 1000);
    ctx.fillText(ago === 0 ? "now" : ago % 60 ? `-${ago}s` : `-${ago / 60}m`, Math.min(xx, width - 14), height - 16);
  }

  ctx.save();
  ctx.beginPath(); ctx.rect(MARGIN.left, MARGIN.top, plotW, plotH); ctx.clip();
  for (const s of series) {
    const points = s.points.filter(([t]) => t >= start - 2000);
    if (!points.length) continue;
    ctx.strokeStyle = ctx.fillStyle = s.color;
    if (s.kind === "bars") {  // the highest point per pixel column: cheap for 100k steps
      const columns = new Map();
      for (const [t, v] of points) {
        const column = Math.round(x(t));
        if (!(columns.get(column) >= v)) columns.set(column, v);
      }
      const barW = Math.max(1, plotW / 600);
      for (const [column, v] of columns) ctx.fillRect(column - barW / 2, y(v), barW, y(0) - y(v));
      continue;
    }
    const trace = () => points.forEach(([t, v], i) => (i ? ctx.lineTo(x(t), y(v)) : ctx.moveTo(x(t), y(v))));
    if (s.kind === "area") {
      ctx.beginPath();
      trace();
      ctx.lineTo(x(points[points.length - 1][0]), y(0));
      ctx.lineTo(x(points[0][0]), y(0));
      ctx.closePath();
      ctx.globalAlpha = 0.3; ctx.fill(); ctx.globalAlpha = 1;
    }
    ctx.beginPath();
    trace();
    ctx.lineWidth = 1.6; ctx.stroke();
  }
  if (hline !== undefined && hline <= top) {  // off the scale: the caption says it
    ctx.setLineDash([4, 4]); ctx.strokeStyle = "#868e96"; ctx.lineWidth = 1;
    ctx.beginPath(); ctx.moveTo(MARGIN.left, y(hline)); ctx.lineTo(width - MARGIN.right, y(hline)); ctx.stroke();
    ctx.setLineDash([]);
  }
  ctx.restore();
}

// A legend of coloured swatches under a chart.
export function legend(element, items) {
  element.replaceChildren(...items.map(([label, color]) => {
    const item = document.createElement("span");
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = color;
    item.append(swatch, label);
    return item;
  }));
}
