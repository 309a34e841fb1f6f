// epd dashboard: polls /dashboard/data every POLL_MS and redraws. No framework, no network but the gateway.
"use strict";
const POLL_MS = 1500;
const KEY = "epd-api-key";
const STAGES = ["encoder", "prefill", "decode"];
// per-worker fields, shown when the worker reports them (label, field)
const FIELDS = [
  ["queue depth", "queue_depth"], ["in flight", "in_flight"], ["from this gateway", "inflight_from_gateway"],
  ["running batch", "running_seqs"], ["largest batch", "max_batch_observed"], ["batch limit", "max_batch_configured"],
  ["free KV blocks", "free_blocks"], ["total KV blocks", "total_blocks"], ["reserved (reservations)", "reservations_active"],
  ["cached KV blocks", "cached_blocks"], ["pending chunks", "pending_chunks"], ["queued prefill tokens", "queued_prefill_tokens"],
  ["encoder cache hits", "cache_hits"], ["encodes computed", "computes"], ["single-flight", "single_flight_in_flight"],
  ["lease reaped", "lease_reaped_total"],
];
// waterfall segments: [css class, label, breakdown key(s)]
const SEGMENTS = [["seg-queue", "gateway queue", ["gateway_queue_ms"]], ["seg-encode", "encode", ["encode_ms"]],
  ["seg-prefill", "prefill", ["prefill_ms", "colocated_prefill_ms"]], ["seg-transfer", "transfer", ["transfer_ms"]]];

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}
const fmt = (v, digits = 1) => (v === null || v === undefined) ? "–" : (typeof v === "number" ? v.toFixed(digits) : String(v));

function drawStages(stages) {
  const root = document.getElementById("stages");
  root.replaceChildren(...STAGES.map((role) => {
    const s = stages[role] || {state: "none", healthy: 0, workers: []};
    const label = {ok: `${s.healthy}/${s.workers.length} healthy`, no_healthy_worker: "no healthy worker",
                   none: "no worker configured"}[s.state];
    const box = el("div", {class: `stage state-${s.state}`, "data-stage": role, "data-state": s.state},
      el("h2", {}, role, el("span", {class: `stage-state ${s.state === "ok" ? "good" : s.state === "none" ? "muted" : "bad"}`}, label)));
    for (const w of s.workers) {
      const rows = FIELDS.filter(([, f]) => w[f] !== undefined)
        .map(([name, f]) => el("tr", {}, el("td", {}, name), el("td", {"data-field": f}, fmt(w[f], 0))));
      box.append(el("div", {class: "worker", "data-address": w.address},
        el("h3", {}, w.address, " ", el("span", {class: w.healthy ? "good" : "bad"}, w.healthy ? "healthy" : "UNHEALTHY")),
        el("table", {}, ...rows)));
    }
    return box;
  }));
}

function tile(id, label, value, cls) {
  return el("div", {class: "tile", id}, el("div", {class: `v ${cls || ""}`}, value), el("div", {class: "k"}, label));
}

function drawWindow(w) {
  const slo = (p, limit) => (p === null ? "" : (p <= limit ? "good" : "bad"));
  const refusals = Object.entries(w.refusals_per_s).filter(([, r]) => r > 0);
  const failed = Object.entries(w.failed_per_s).filter(([, r]) => r > 0);
  document.getElementById("rates").replaceChildren(
    tile("rate-requests", `requests/s (${fmt(w.seconds, 0)} s)`, fmt(w.requests_per_s, 2)),
    tile("rate-refusals", "refusals/s by reason",
         refusals.length ? refusals.map(([k, r]) => `${k} ${fmt(r, 2)}`).join(", ") : "0"),
    tile("rate-failures", "failures/s by reason",
         failed.length ? failed.map(([k, r]) => `${k} ${fmt(r, 2)}`).join(", ") : "0"),
    tile("ttft-p50", `TTFT p50 ms (SLO ${w.ttft_ms.slo})`, fmt(w.ttft_ms.p50), slo(w.ttft_ms.p50, w.ttft_ms.slo)),
    tile("ttft-p99", `TTFT p99 ms (${w.ttft_ms.samples} req)`, fmt(w.ttft_ms.p99), slo(w.ttft_ms.p99, w.ttft_ms.slo)),
    tile("itl-p50", `ITL p50 ms (SLO ${w.itl_ms.slo})`, fmt(w.itl_ms.p50), slo(w.itl_ms.p50, w.itl_ms.slo)),
    tile("itl-p99", `ITL p99 ms (${w.itl_ms.samples} tokens)`, fmt(w.itl_ms.p99), slo(w.itl_ms.p99, w.itl_ms.slo)),
    tile("kv-gbps", "KV transfer GB/s", fmt(w.kv_transfer_gb_per_s, 4)),
    tile("cache-hit-rate", "image cache hit rate", w.image_cache_hit_rate === null ? "–" : `${fmt(100 * w.image_cache_hit_rate, 0)}%`),
  );
}

function drawCosts(cost) {
  const head = el("tr", {}, ...["stage", "samples (1 min)", "mean size", "measured ms", "fit ms", "fit: a", "fit: b", "fit points", "fitted"]
    .map((h) => el("th", {}, h)));
  const rows = Object.entries(cost.fit || {}).map(([kind, f]) => {
    const m = (cost.measured || {})[kind] || {samples: 0};
    return el("tr", {"data-kind": kind}, el("td", {}, kind), el("td", {}, m.samples), el("td", {}, fmt(m.mean_size)),
      el("td", {}, fmt(m.measured_ms, 2)), el("td", {}, fmt(m.fitted_ms, 2)), el("td", {}, fmt(f.intercept, 3)),
      el("td", {}, fmt(f.slope, 5)), el("td", {}, f.points), el("td", {}, f.fitted ? "yes" : "prior"));
  });
  document.getElementById("cost-table").replaceChildren(head, ...rows);
}

function segments(r) {
  const b = r.breakdown || {};
  const out = [];
  let used = 0;
  for (const [cls, label, keys] of SEGMENTS) {
    let ms = keys.reduce((sum, k) => sum + (b[k] || 0), 0);
    let kind = cls;
    if (cls === "seg-encode" && ms === 0 && (b.images_cache_hit || 0) > 0) { kind = "seg-hit"; }
    if (ms > 0 || kind === "seg-hit") { out.push([kind, kind === "seg-hit" ? "cache hit" : label, ms]); used += ms; }
  }
  if (r.ttft_ms !== null && r.ttft_ms !== undefined) out.push(["seg-step", "first step", Math.max(0, r.ttft_ms - used)]);
  return out;
}

function drawRecent(recent) {
  const longest = Math.max(1, ...recent.map((r) => r.ttft_ms || 0));
  document.getElementById("waterfall").replaceChildren(...recent.slice(0, 30).map((r) => {
    const bar = el("div", {class: "bar"});
    for (const [cls, label, ms] of segments(r)) {
      bar.append(el("i", {class: cls, title: `${label} ${fmt(ms)} ms`, style: `width:${(100 * ms / longest).toFixed(2)}%`}));
    }
    const ok = r.outcome === "stop" || r.outcome === "length";
    return el("div", {class: "row", "data-request": r.request_id},
      el("span", {title: r.request_id}, r.request_id.slice(-12), " ", el("span", {class: ok ? "good" : "bad"}, r.outcome)),
      el("span", {}, `${r.placement || "–"} (${r.placement_reason || "–"}) ${r.prompt_tokens}+${r.completion_tokens} tok`),
      bar, el("span", {}, r.ttft_ms === null ? "–" : `${fmt(r.ttft_ms)} ms`));
  }));
}

function askForKey(message) {
  document.getElementById("key-form").hidden = false;
  document.getElementById("key-error").textContent = message || "";
}

let timer = null;
function schedule(ms) { clearTimeout(timer); timer = setTimeout(poll, ms); }   // one polling loop, ever

async function poll() {
  const key = localStorage.getItem(KEY);
  document.getElementById("forget-key").hidden = !key;
  try {
    const response = await fetch("/dashboard/data", {headers: key ? {Authorization: `Bearer ${key}`} : {}, cache: "no-store"});
    if (response.status === 401) {
      askForKey(key ? "that key was refused" : "this gateway needs an API key");
      document.getElementById("updated").textContent = "waiting for an API key";
      return;   // polling resumes once a key is entered
    }
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const d = await response.json();
    document.getElementById("key-form").hidden = true;
    document.getElementById("model").textContent = d.model;
    document.getElementById("placement-mode").textContent = `placement: ${d.placement_mode}, waiting first token: ${d.waiting_first_token}`;
    drawStages(d.stages);
    drawWindow(d.window);
    drawCosts(d.cost_model);
    drawRecent(d.recent);
    document.getElementById("updated").textContent = `updated ${new Date(d.time_unix * 1000).toLocaleTimeString()}`;
    document.body.dataset.ready = "1";
  } catch (err) {
    document.getElementById("updated").textContent = `gateway unreachable (${err.message})`;
  }
  schedule(POLL_MS);
}

document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  localStorage.setItem(KEY, document.getElementById("key-input").value.trim());
  schedule(0);
});
document.getElementById("forget-key").addEventListener("click", () => { localStorage.removeItem(KEY); schedule(0); });
schedule(0);
