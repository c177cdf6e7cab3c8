// The hsdp dashboard: polls GET /api/state once a second and renders it; the policy form posts
// to /api/policy with the control token; the timeline polls GET /api/trace (the newest traced
// steps, Chrome trace JSON as `hsdpctl trace` writes it). No dependencies: plain DOM and SVG.
'use strict';

const POLL_MS = 1000;
// Steps already shown are fetched again this far back: a step's point changes until every rank
// reported it.
const REFETCH_STEPS = 8;
const SVG_NS = 'http://www.w3.org/2000/svg';
const CHART = {width: 600, height: 220, left: 56, right: 12, top: 12, bottom: 28};

const points = new Map();  // step -> StepPoint (numbers)
let historyCapacity = 2048;
let lastState = null;

function $(id) { return document.getElementById(id); }

// proto3 JSON prints 64-bit integers as strings.
function num(v) { return v === undefined || v === null ? 0 : Number(v); }

function text(el, value) { el.textContent = value; }

function fmtBytes(bytes) {
  bytes = num(bytes);
  if (bytes <= 0) return '-';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (bytes >= 1024 && i < units.length - 1) { bytes /= 1024; ++i; }
  return (i === 0 ? bytes.toFixed(0) : bytes.toFixed(1)) + ' ' + units[i];
}

function fmtSeconds(s) {
  s = num(s);
  if (s <= 0) return '-';
  return s < 1 ? (s * 1000).toFixed(1) + ' ms' : s.toFixed(3) + ' s';
}

function fmtStep(step) { step = num(step); return step < 0 ? 'none' : String(step); }

function shortEnum(name, prefix) {
  return typeof name === 'string' && name.startsWith(prefix) ? name.slice(prefix.length) : name;
}

function row(cells) {
  const tr = document.createElement('tr');
  for (const c of cells) {
    const td = document.createElement('td');
    if (c instanceof Node) td.appendChild(c); else td.textContent = c;
    tr.appendChild(td);
  }
  return tr;
}

function svg(tag, attrs, content) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (content !== undefined) el.textContent = content;
  return el;
}

// A line chart of series[i] = [step, value]; marks = [{step, label}] as dashed verticals.
function drawChart(el, series, marks, format) {
  while (el.firstChild) el.removeChild(el.firstChild);
  const w = CHART.width - CHART.left - CHART.right;
  const h = CHART.height - CHART.top - CHART.bottom;
  el.appendChild(svg('rect', {x: CHART.left, y: CHART.top, width: w, height: h, class: 'plot'}));
  const finite = series.filter(([, v]) => Number.isFinite(v));
  el.dataset.points = String(finite.length);
  if (finite.length === 0) {
    el.appendChild(svg('text', {x: CHART.left + w / 2, y: CHART.top + h / 2, class: 'empty'},
                       'no steps reported yet'));
    return;
  }
  const x0 = finite[0][0], x1 = Math.max(finite[finite.length - 1][0], x0 + 1);
  let y0 = Math.min(...finite.map(([, v]) => v)), y1 = Math.max(...finite.map(([, v]) => v));
  if (y1 - y0 < 1e-12) { y0 -= 0.5 * Math.abs(y0 || 1); y1 += 0.5 * Math.abs(y1 || 1); }
  const pad = 0.05 * (y1 - y0);
  y0 -= pad; y1 += pad;
  const sx = (x) => CHART.left + (x - x0) / (x1 - x0) * w;
  const sy = (y) => CHART.top + (1 - (y - y0) / (y1 - y0)) * h;
  for (let i = 0; i <= 4; ++i) {
    const v = y0 + (y1 - y0) * i / 4;
    el.appendChild(svg('line', {x1: CHART.left, x2: CHART.left + w, y1: sy(v), y2: sy(v),
                                class: 'grid'}));
    el.appendChild(svg('text', {x: CHART.left - 6, y: sy(v) + 4, class: 'ylabel'}, format(v)));
  }
  el.appendChild(svg('text', {x: CHART.left, y: CHART.height - 8, class: 'xlabel'},
                     'step ' + x0));
  el.appendChild(svg('text', {x: CHART.left + w, y: CHART.height - 8, class: 'xlabel end'},
                     'step ' + finite[finite.length - 1][0]));
  for (const m of marks) {
    if (m.step < x0 || m.step > x1) continue;
    el.appendChild(svg('line', {x1: sx(m.step), x2: sx(m.step), y1: CHART.top,
                                y2: CHART.top + h, class: 'mark'}));
    el.appendChild(svg('text', {x: sx(m.step) + 4, y: CHART.top + 14, class: 'mark-label'},
                       m.label));
  }
  const path = finite.map(([x, y]) => sx(x).toFixed(1) + ',' + sy(y).toFixed(1)).join(' ');
  el.appendChild(svg('polyline', {points: path, class: 'series'}));
}

function renderSummary(status) {
  text($('job-id'), status.job_id || '');
  const state = shortEnum(status.state, 'JOB_STATE_');
  const badge = $('job-state');
  text(badge, state);
  badge.className = 'badge state-' + String(state).toLowerCase();
  text($('generation'), num(status.generation));
  text($('sealed-step'), fmtStep(status.sealed_step));
  text($('policy-version'), num(status.policy_version));
  text($('workers-alive'), status.workers_alive + ' / ' + status.world_size);
  text($('mesh'), status.mesh ? status.mesh.replicate + ' × ' + status.mesh.shard : '-');
  text($('model'), status.model || '-');
  text($('last-checkpoint'), fmtStep(status.last_checkpoint_step));
  text($('drain-step'), fmtStep(status.drain_step));
  document.title = 'hsdp ' + (status.job_id || '') + ' · ' + state;
}

function renderWorkers(workers) {
  const body = $('workers').tBodies[0];
  body.replaceChildren(...workers.map((w) => {
    const r = w.last_report;
    const state = shortEnum(w.state, 'WORKER_STATE_');
    const tr = row([w.rank, state, w.hostname || '-', w.device || '-',
                    w.replicate_index + ' × ' + w.shard_index, num(w.heartbeat_age_ms) + ' ms',
                    r ? num(r.step) : '-', r ? num(r.loss).toFixed(4) : '-',
                    r ? fmtSeconds(r.step_seconds) : '-', r ? fmtBytes(r.peak_memory_bytes) : '-']);
    tr.className = 'worker state-' + String(state).toLowerCase();
    return tr;
  }));
}

function bar(fraction, label) {
  const wrap = document.createElement('div');
  wrap.className = 'bar';
  const fill = document.createElement('span');
  fill.style.width = (100 * Math.max(0, Math.min(1, fraction))).toFixed(1) + '%';
  const caption = document.createElement('em');
  caption.textContent = label;
  wrap.append(fill, caption);
  return wrap;
}

function renderUnits(units) {
  const maxBytes = Math.max(1, ...units.map((u) => num(u.param_bytes)));
  const maxComm = Math.max(1e-9, ...units.map(
      (u) => Math.max(num(u.all_gather_seconds), num(u.reduce_scatter_seconds))));
  $('units').tBodies[0].replaceChildren(...units.map((u) => {
    const held = u.reshard_after_forward ? num(u.shard_bytes) : num(u.param_bytes);
    return row([u.name, num(u.param_count).toLocaleString('en-US'), fmtBytes(u.param_bytes),
                fmtBytes(u.shard_bytes),
                (u.reshard_after_forward ? 'yes' : 'no') + ' / ' +
                    (u.reshard_after_backward ? 'yes' : 'no'),
                bar(held / maxBytes, fmtBytes(held) +
                    (u.reshard_after_forward ? ' (shard)' : ' (unsharded)')),
                u.comm_reports ? bar(num(u.all_gather_seconds) / maxComm,
                                     fmtSeconds(u.all_gather_seconds)) : '-',
                u.comm_reports ? bar(num(u.reduce_scatter_seconds) / maxComm,
                                     fmtSeconds(u.reduce_scatter_seconds)) : '-']);
  }));
}

function renderPolicy(state) {
  text($('policy-text'), state.policy_text || '');
  const p = state.policy;
  text($('policy-effective'), '(version ' + num(p.policy_version) + ', from step ' +
       num(p.effective_step) + ')');
  $('token-label').hidden = !state.token_required;
}

function renderCharts(state) {
  const steps = [...points.keys()].sort((a, b) => a - b);
  const loss = steps.map((s) => [s, points.get(s).loss]);
  const time = steps.map((s) => [s, points.get(s).step_seconds]);
  const marks = (state.policy_history || []).filter((m) => num(m.version) > 1)
      .map((m) => ({step: num(m.effective_step), label: 'policy v' + num(m.version)}));
  drawChart($('loss-chart'), loss, marks, (v) => v.toFixed(3));
  drawChart($('time-chart'), time, marks, (v) => v.toFixed(3));
  if (loss.length > 0) {
    const [s0, l0] = loss[0], [s1, l1] = loss[loss.length - 1];
    text($('loss-summary'), l0.toFixed(4) + ' at step ' + s0 + ' → ' + l1.toFixed(4) +
         ' at step ' + s1);
    const t = time.slice(-20).map(([, v]) => v);
    text($('time-summary'), 'last 20 steps: mean ' +
         fmtSeconds(t.reduce((a, b) => a + b, 0) / t.length));
  } else {
    text($('loss-summary'), '');
    text($('time-summary'), '');
  }
}

function mergeHistory(history) {
  for (const p of history || []) {
    points.set(num(p.step), {loss: num(p.loss), step_seconds: num(p.step_seconds)});
  }
  const steps = [...points.keys()].sort((a, b) => a - b);
  for (let i = 0; i < steps.length - historyCapacity; ++i) points.delete(steps[i]);
}

async function poll() {
  const steps = [...points.keys()];
  const since = steps.length === 0 ? -1 : Math.max(-1, Math.max(...steps) - REFETCH_STEPS);
  try {
    const response = await fetch('/api/state?since=' + since, {cache: 'no-store'});
    if (!response.ok) throw new Error('HTTP ' + response.status);
    const state = await response.json();
    lastState = state;
    historyCapacity = num(state.history_capacity) || historyCapacity;
    mergeHistory(state.history);
    renderSummary(state.status);
    renderWorkers(state.workers || []);
    renderUnits(state.units || []);
    renderPolicy(state);
    renderCharts(state);
    text($('connection'), '');
    text($('updated'), new Date().toLocaleTimeString());
  } catch (e) {
    text($('connection'), 'coordinator unreachable (' + e.message + '), retrying');
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

// The form's changes on top of `current`, as `hsdpctl policy set` applies its flags.
function policyFromForm(current, form) {
  const p = JSON.parse(JSON.stringify(current || {}));
  const v = (name) => form.elements[name].value.trim();
  const bool = (name) => (v(name) === '' ? undefined : v(name) === 'true');
  const raf = bool('reshard_after_forward'), rab = bool('reshard_after_backward');
  if (v('units') !== '') {
    if (raf === undefined && rab === undefined) {
      throw new Error('"only units matching" needs reshard after forward and/or backward');
    }
    const o = {unit_glob: v('units')};
    if (raf !== undefined) o.reshard_after_forward = raf;
    if (rab !== undefined) o.reshard_after_backward = rab;
    p.overrides = (p.overrides || []).concat([o]);
  } else {
    if (raf !== undefined) p.reshard_after_forward = raf;
    if (rab !== undefined) p.reshard_after_backward = rab;
  }
  for (const name of ['forward_prefetch_depth', 'backward_prefetch_depth', 'microbatches',
                      'checkpoint_interval', 'memory_budget_bytes']) {
    if (v(name) !== '') p[name] = Number(v(name));
  }
  if (v('grad_sync') !== '') {
    p.grad_sync = v('grad_sync') === 'every' ? 'GRAD_SYNC_MODE_EVERY_MICROBATCH'
                                             : 'GRAD_SYNC_MODE_LAST_MICROBATCH';
  }
  if (v('all_reduce') !== '') {
    p.all_reduce = v('all_reduce') === 'every' ? 'ALL_REDUCE_MODE_EVERY_MICROBATCH'
                                               : 'ALL_REDUCE_MODE_LAST_MICROBATCH';
  }
  return p;
}

async function submitPolicy(event) {
  event.preventDefault();
  const form = event.target;
  const result = $('policy-result');
  result.className = '';
  let policy;
  try {
    if (!lastState) throw new Error('no state from the coordinator yet');
    policy = policyFromForm(lastState.policy.policy, form);
  } catch (e) {
    result.className = 'error';
    text(result, e.message);
    return;
  }
  const headers = {'Content-Type': 'application/json'};
  const token = form.elements.token.value.trim();
  if (token !== '') headers.Authorization = 'Bearer ' + token;
  try {
    const response = await fetch('/api/policy', {method: 'POST', headers,
                                                  body: JSON.stringify(policy)});
    const body = await response.json();
    if (!response.ok) {
      result.className = 'error';
      text(result, 'refused: ' + body.code + ': ' + body.message);
      return;
    }
    result.className = 'ok';
    text(result, 'policy version ' + num(body.policy_version) + ' applies from step ' +
         num(body.effective_step));
    for (const el of form.elements) {
      if (el.name && el.name !== 'token') el.value = '';
    }
  } catch (e) {
    result.className = 'error';
    text(result, 'request failed: ' + e.message);
  }
}

// ---- the timeline ----------------------------------------------------------------------------

const TRACE_POLL_MS = 3000;
const TIMELINE = {width: 1200, label: 150, right: 10, top: 22, rowHeight: 22, rowGap: 4};
// Span colours by what the span is; the first matching prefix wins.
const SPAN_KINDS = [
  ['wait', '#bab0ac'], ['all-gather', '#59a14f'], ['reduce-scatter', '#f28e2b'],
  ['all-reduce', '#e15759'], ['forward', '#4e79a7'], ['recompute', '#76b7b2'],
  ['backward', '#9c755f'], ['optimizer', '#b07aa1'], ['schedule fetch', '#edc948'],
  ['checkpoint', '#ff9da7'], ['step', '#e8e8e8'],
];
let shownTrace = '';

function spanColour(name) {
  for (const [prefix, colour] of SPAN_KINDS) {
    if (name.startsWith(prefix)) return colour;
  }
  return '#cccccc';
}

// Rows (one per rank and thread that has spans) with each span's nesting depth.
function timelineRows(trace) {
  const processNames = new Map();
  const threadNames = new Map();
  const rows = new Map();
  for (const e of trace.traceEvents || []) {
    if (e.ph === 'M' && e.name === 'process_name') processNames.set(e.pid, e.args.name);
    if (e.ph === 'M' && e.name === 'thread_name') threadNames.set(`${e.pid}/${e.tid}`, e.args.name);
    if (e.ph !== 'X') continue;
    const key = `${e.pid}/${e.tid}`;
    if (!rows.has(key)) rows.set(key, {pid: e.pid, tid: e.tid, spans: []});
    rows.get(key).spans.push(e);
  }
  const sorted = [...rows.values()].sort((a, b) => a.pid - b.pid || a.tid - b.tid);
  for (const r of sorted) {
    r.label = `${processNames.get(r.pid) || 'rank ' + r.pid} · ` +
              `${threadNames.get(`${r.pid}/${r.tid}`) || r.tid}`;
    r.spans.sort((a, b) => a.ts - b.ts || b.dur - a.dur);
    const open = [];  // end times of the spans containing the current one
    r.depth = 1;
    for (const s of r.spans) {
      while (open.length && open[open.length - 1] <= s.ts) open.pop();
      s.depth = open.length;
      open.push(s.ts + s.dur);
      r.depth = Math.max(r.depth, open.length);
    }
  }
  return sorted;
}

function renderTimeline(trace) {
  const chart = $('timeline-chart');
  const rows = timelineRows(trace);
  let end = 0;
  for (const r of rows) for (const s of r.spans) end = Math.max(end, s.ts + s.dur);
  const T = TIMELINE;
  const height = T.top + rows.length * (T.rowHeight + T.rowGap) + 4;
  chart.setAttribute('viewBox', `0 0 ${T.width} ${height}`);
  chart.replaceChildren();
  const plot = T.width - T.label - T.right;
  const x = (us) => T.label + (end > 0 ? us / end * plot : 0);
  for (let i = 0; i <= 4; ++i) {
    const us = end * i / 4;
    chart.appendChild(svg('line', {x1: x(us), x2: x(us), y1: T.top - 4, y2: height,
                                   class: 'grid'}));
    chart.appendChild(svg('text', {x: x(us), y: T.top - 8, class: 'axis',
                                   'text-anchor': i === 0 ? 'start' : i === 4 ? 'end' : 'middle'},
                          (us / 1000).toFixed(1) + ' ms'));
  }
  let spans = 0;
  rows.forEach((r, i) => {
    const y = T.top + i * (T.rowHeight + T.rowGap);
    chart.appendChild(svg('text', {x: 4, y: y + T.rowHeight * 0.7, class: 'axis'}, r.label));
    const h = T.rowHeight / r.depth;
    for (const s of r.spans) {
      const rect = svg('rect', {x: x(s.ts), y: y + s.depth * h,
                                width: Math.max(0.5, x(s.ts + s.dur) - x(s.ts)),
                                height: Math.max(1, h - 1), fill: spanColour(s.name),
                                class: 'span'});
      const a = s.args || {};
      rect.appendChild(svg('title', {}, `${s.name}${a.unit ? ' · ' + a.unit : ''}` +
                                        ` · step ${a.step} · microbatch ${a.microbatch}` +
                                        ` · ${(s.dur / 1000).toFixed(3)} ms`));
      chart.appendChild(rect);
      ++spans;
    }
  });
  chart.dataset.rows = String(rows.length);
  chart.dataset.ranks = String(new Set(rows.map((r) => r.pid)).size);
  chart.dataset.spans = String(spans);
  const legend = $('timeline-legend');
  legend.replaceChildren();
  for (const [name, colour] of SPAN_KINDS) {
    const item = document.createElement('span');
    item.className = 'legend-item';
    item.style.setProperty('--swatch', colour);
    item.textContent = name;
    legend.appendChild(item);
  }
  const o = trace.otherData || {};
  const error = num(o.max_clock_error_nanos) / 1000;
  text($('timeline-range'),
       `steps ${o.first_step}..${o.last_step}` + (o.complete ? '' : ' (not every rank yet)') +
       ` · ${new Set(rows.map((r) => r.pid)).size} ranks aligned within ±${error.toFixed(0)} µs` +
       ' · hover a span for its unit and duration');
}

async function pollTrace() {
  try {
    const response = await fetch('/api/trace', {cache: 'no-store'});
    if (response.ok) {
      const body = await response.text();
      if (body !== shownTrace) {
        shownTrace = body;
        renderTimeline(JSON.parse(body));
      }
    }
  } catch (e) {
    // The state poll reports the connection; the timeline keeps what it shows.
  }
  setTimeout(pollTrace, TRACE_POLL_MS);
}

document.addEventListener('DOMContentLoaded', () => {
  $('policy-form').addEventListener('submit', submitPolicy);
  poll();
  pollTrace();
});
