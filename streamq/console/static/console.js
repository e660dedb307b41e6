// The console page: each server-sent snapshot (/api/events) re-renders the tables; the
// lag charts (uPlot) are kept and given new data; the tail asks /api/tail each second.
"use strict";

const $ = (selector) => document.querySelector(selector);
const escape = (text) =>
  String(text ?? "").replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
const number = (n) => (n === null || n === undefined ? "" : Number(n).toLocaleString("en"));
const bytes = (n) => {
  if (n === null || n === undefined) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
};
const ago = (ms) => {
  if (!ms) return "";
  const s = Math.max(0, (Date.now() - ms) / 1000);
  if (s >= 86400) return `${Math.floor(s / 86400)} d ago`;
  if (s >= 3600) return `${Math.floor(s / 3600)} h ago`;
  if (s >= 60) return `${Math.floor(s / 60)} min ago`;
  return `${s.toFixed(0)} s ago`;
};
const duration = (ms) => {
  if (ms === null || ms === undefined) return "none";
  const s = ms / 1000;
  if (s >= 86400) return `${+(s / 86400).toFixed(1)} d`;
  if (s >= 3600) return `${+(s / 3600).toFixed(1)} h`;
  if (s >= 60) return `${+(s / 60).toFixed(1)} min`;
  return `${+s.toFixed(1)} s`;
};

function table(headers, rows, attributes = () => "") {
  const head = headers
    .map(([label, cls]) => `<th class="${cls || ""}">${escape(label)}</th>`)
    .join("");
  const body = rows
    .map((row, i) => `<tr ${attributes(i)}>${row.join("")}</tr>`)
    .join("");
  return `<table><thead><tr>${head}</tr></thead><tbody>${body}</tbody></table>`;
}
const cell = (value, cls = "") => `<td class="${cls}">${escape(value)}</td>`;
const data = (name, value) => `data-${name}="${escape(value)}"`;
const lagText = (lag, exact) => (lag === null || lag === undefined ? "" : `${exact ? "" : "≤ "}${number(lag)}`);

// --- producers ---------------------------------------------------------------------

function renderProducers(producers) {
  const parts = producers.map((p) => {
    if (p.error) {
      return `<div class="producer" ${data("address", p.address)}><h3>${escape(p.address)}</h3>
        <p class="error">unreachable: ${escape(p.error)}</p></div>`;
    }
    const streams = table(
      [["stream"], ["head", "num"], ["first held", "num"], ["records/s", "num"], ["retention"], ["kind"]],
      p.streams.map((s) => [
        cell(s.stream),
        cell(number(s.head), "num head"),
        cell(number(s.low), "num"),
        cell(s.rate === null || s.rate === undefined ? "" : s.rate.toFixed(1), "num rate"),
        cell(retention(s)),
        cell(s.compact ? "compacted" : ""),
      ]),
      (i) => data("stream", p.streams[i].stream),
    );
    return `<div class="producer" ${data("address", p.address)}>
      <h3>${escape(p.address)} <span class="muted">producer ${escape(p.producer_id)} · epoch
      ${escape(p.epoch)} · ${escape(p.connections)} connection(s) · ${escape(p.build)}</span></h3>
      ${publishing(p)}${capture(p.capture)}${streams}</div>`;
  });
  $("#producers .body").innerHTML = parts.join("") || '<p class="muted">no producers</p>';
}

function retention(s) {
  if (s.retention_ms == null && s.retention_bytes == null) return "kept (no cap)";
  const caps = [];
  if (s.retention_ms != null) caps.push(duration(s.retention_ms));
  if (s.retention_bytes != null) caps.push(bytes(s.retention_bytes));
  return caps.join(", ");
}

function publishing(p) {
  const open = p.open_transactions;
  if (!open || !open.count) return "";
  return `<p class="muted">${open.count} transaction(s) published and not ended, the oldest
    open ${(open.oldest_age_ms / 1000).toFixed(1)} s</p>`;
}

// A status's table names: a list, or a map of table -> stream.
const names = (tables) => (Array.isArray(tables) ? tables : Object.keys(tables || {})).join(", ");

function capture(c) {
  if (!c) return "";
  const snapshot = c.snapshot
    ? ` · snapshot of ${escape(names(c.snapshot.tables))}: ${number(c.snapshot.rows)} of ${number(c.snapshot.of)} rows`
    : "";
  return `<p class="capture">capturing ${escape(names(c.tables))} (slot ${escape(c.slot)}):
    published up to LSN ${escape(c.lsn)}, ${number(c.changes)} change(s) since start;
    slot lag <span class="slot-lag">${bytes(c.retained_wal_bytes)}</span> of WAL${snapshot}</p>`;
}

// --- consumers and their lag charts --------------------------------------------------

const charts = new Map(); // "address consumer stream" -> uPlot

function renderConsumers(producers) {
  const rows = [];
  for (const p of producers) for (const c of p.consumers || []) rows.push([p, c]);
  const order = ([p, c]) => `${c.consumer}\u0000${c.stream}\u0000${p.address}`;
  rows.sort((a, b) => (order(a) < order(b) ? -1 : order(a) > order(b) ? 1 : 0));
  $("#consumers .body").innerHTML = rows.length
    ? table(
        [["producer"], ["consumer"], ["stream"], ["applied", "num"], ["lag", "num"],
         ["registered"], ["last report"], ["connected from"]],
        rows.map(([p, c]) => [
          cell(p.address),
          cell(c.consumer),
          cell(c.stream),
          cell(number(c.applied), "num applied"),
          cell(lagText(c.lag, c.exact), `num lag ${c.lag > 0 ? "lagging" : ""}`),
          cell(c.registered ? "yes" : c.dropped ? "dropped" : ""),
          cell(ago(c.updated_at)),
          c.connected
            ? cell((c.peers || []).join(", ") || "yes")
            : cell(`not connected: as of last report${c.updated_at ? `, ${ago(c.updated_at)}` : ""}`, "muted"),
        ]),
        (i) => `${data("producer", rows[i][0].address)} ${data("consumer", rows[i][1].consumer)} ${data("stream", rows[i][1].stream)}`,
      )
    : '<p class="muted">no consumer has connected or reported a position</p>';
  renderCharts(rows);
}

// One chart per consumer: a group's shares (NAME[i/n]) summed into one, NAME's.
function chartLines(rows) {
  const lines = new Map();
  for (const [p, c] of rows) {
    const share = /^(.*)\[(\d+)\/(\d+)\]$/.exec(c.consumer);
    const name = share ? share[1] : c.consumer;
    const id = `${p.address} ${name} ${c.stream}`;
    let line = lines.get(id);
    if (!line) {
      const title = share ? `${name} (${share[3]} shares)` : name;
      line = { id, name, stream: c.stream, title: `${title} on ${c.stream} at ${p.address}`, lags: new Map() };
      lines.set(id, line);
    }
    for (const [t, lag] of c.history) line.lags.set(t, (line.lags.get(t) || 0) + lag);
  }
  return [...lines.values()];
}

function renderCharts(rows) {
  const seen = new Set();
  for (const line of chartLines(rows)) {
    seen.add(line.id);
    const times = [...line.lags.keys()].sort((a, b) => a - b);
    const series = [times, times.map((t) => line.lags.get(t))];
    let chart = charts.get(line.id);
    if (!chart) {
      const box = document.createElement("div");
      box.className = "chart";
      box.dataset.consumer = line.name;
      box.dataset.stream = line.stream;
      box.innerHTML = `<div class="title">${escape(line.title)}: lag</div>`;
      $("#charts").append(box);
      chart = new uPlot(
        {
          width: 320, height: 120, legend: { show: false },
          scales: { y: { range: (u, min, max) => [0, Math.max(10, max * 1.1)] } },
          series: [{}, { label: "lag", stroke: "#3b5bdb", fill: "rgba(59,91,219,0.12)", width: 1.5 }],
          axes: [{ size: 28 }, { size: 46 }],
        },
        series,
        box,
      );
      charts.set(line.id, chart);
    } else {
      chart.setData(series);
    }
    chart.root.parentElement.dataset.points = times.length;
  }
  for (const [id, chart] of charts) {
    if (!seen.has(id)) {
      chart.root.parentElement.remove();
      chart.destroy();
      charts.delete(id);
    }
  }
}

// --- groups ------------------------------------------------------------------------

function renderGroups(groups, databases) {
  const failed = databases
    .filter((d) => d.error)
    .map((d) => `<p class="error">${escape(d.database)}: ${escape(d.error)}</p>`);
  const parts = groups.map((g) => {
    const alive = g.members.filter((m) => m.alive).length;
    const members = table(
      [["member"], ["host"], ["pid", "num"], ["alive"], ["renews within"], ["shares held"]],
      g.members.map((m) => [
        cell(m.member),
        cell(m.host ?? "", "host"),
        cell(m.pid ?? "", "num pid"),
        cell(m.alive ? "yes" : "no", m.alive ? "ok" : "error"),
        cell(renews(m)),
        cell(m.shares.join(", ")),
      ]),
      (i) => data("member", g.members[i].member),
    );
    const shares = table(
      [["share"], ["holder"], ["held for"], ["producer"], ["applied", "num"], ["head", "num"], ["lag", "num"], ["parked", "num"]],
      g.positions.map((r) => [
        cell(r.share),
        cell(r.holder ?? "free", r.holder ? "" : "muted"),
        cell(held(r), r.lease === "expired" ? "held error" : "held"),
        cell(r.endpoint || r.producer_id || ""),
        cell(number(r.applied), "num"),
        cell(number(r.head), "num"),
        cell(lagText(r.behind, r.exact), "num lag"),
        cell(r.parked || "", "num"),
      ]),
      (i) => data("share", g.positions[i].share),
    );
    const total = g.positions.reduce((sum, r) => sum + (r.behind || 0), 0);
    return `<div class="group" ${data("group", g.group)}><h3>${escape(g.group)} on
      ${escape(g.stream)} <span class="muted">${escape(g.database)} · ${g.shares} shares ·
      ${alive} of ${g.members.length} member(s) alive · lag ${number(total)}</span></h3>
      ${members}${shares}</div>`;
  });
  $("#groups .body").innerHTML =
    failed.join("") + (parts.join("") || '<p class="muted">no consumer groups in the databases given</p>');
}

// When a member must renew its row, or since when it has expired (as streamq groups says).
function renews(m) {
  if (m.expires_in_ms <= 0) return `expired ${duration(-m.expires_in_ms)} ago`;
  if (!m.alive) return "never: its process ended";
  return `${(m.expires_in_ms / 1000).toFixed(1)} s`;
}

// How long a share's lease has been held, or since when it has expired.
function held(r) {
  if (r.lease === "expired") return r.expired_ms == null ? "expired" : `expired ${duration(r.expired_ms)} ago`;
  return r.held_ms == null ? "" : duration(r.held_ms);
}

// --- dead letters ------------------------------------------------------------------

let actions = false;

function renderParked(parked) {
  $("#parked .body").innerHTML = parked.length
    ? table(
        [["consumer"], ["stream"], ["seq", "num"], ["key"], ["attempts", "num"], ["parked"], ["error"], [""]],
        parked.map((p) => [
          cell(p.consumer),
          cell(p.stream),
          cell(p.seq, "num"),
          cell(p.key ?? ""),
          cell(p.attempts, "num"),
          cell(ago(p.parked_at)),
          cell(p.error, "value"),
          p.retry_requested_at
            ? cell("retry requested", "muted")
            : `<td><button class="retry" ${actions ? "" : "disabled title='needs an admin token'"}>retry</button></td>`,
        ]),
        (i) => `${data("database", parked[i].database)} ${data("consumer", parked[i].consumer)} ${data("stream", parked[i].stream)} ${data("seq", parked[i].seq)}`,
      )
    : '<p class="muted">no parked records</p>';
}

$("#parked").addEventListener("click", async (event) => {
  if (!event.target.matches("button.retry")) return;
  const row = event.target.closest("tr").dataset;
  event.target.disabled = true;
  const answer = await fetch("/api/dead-letters/retry", {
    method: "POST",
    headers: {
      "Content-Type": "application/json",
      Authorization: `Bearer ${sessionStorage.getItem("streamq-admin-token") || ""}`,
    },
    body: JSON.stringify({ database: row.database, consumer: row.consumer, stream: row.stream, seq: Number(row.seq) }),
  });
  const body = await answer.json();
  $("#admin-state").textContent = answer.ok ? `marked ${body.marked} for retry` : body.error;
  $("#admin-state").className = answer.ok ? "ok" : "error";
});

$("#admin").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("streamq-admin-token", $("#admin-token").value.trim());
  $("#admin-token").value = "";
  $("#admin-state").textContent = "token set for this tab";
  $("#admin-state").className = "muted";
});

// --- the tail ----------------------------------------------------------------------

const tail = { key: "", after: null, records: [], timer: null };

function renderTailChoices(producers) {
  const select = $("#tail-stream");
  const wanted = producers.flatMap((p) =>
    (p.streams || []).map((s) => JSON.stringify([p.address, s.stream])),
  );
  const have = [...select.options].map((o) => o.value).filter(Boolean);
  if (JSON.stringify(wanted) === JSON.stringify(have)) return;
  const chosen = select.value;
  select.innerHTML =
    '<option value="">choose a stream</option>' +
    wanted
      .map((value) => {
        const [address, stream] = JSON.parse(value);
        return `<option value="${escape(value)}">${escape(stream)} at ${escape(address)}</option>`;
      })
      .join("");
  select.value = wanted.includes(chosen) ? chosen : "";
}

$("#tail-stream").addEventListener("change", () => {
  tail.key = $("#tail-stream").value;
  tail.after = null;
  tail.records = [];
  renderTail();
  clearTimeout(tail.timer);
  if (tail.key) readTail();
});

async function readTail() {
  const key = tail.key;
  const [address, stream] = JSON.parse(key);
  const query = new URLSearchParams({ producer: address, stream });
  if (tail.after !== null) query.set("after", tail.after);
  try {
    const answer = await fetch(`/api/tail?${query}`);
    const body = await answer.json();
    if (key !== tail.key) return;
    if (answer.ok) {
      tail.records = [...body.records.reverse(), ...tail.records].slice(0, 50);
      tail.after = body.head;
      $("#tail-state").textContent = `head ${number(body.head)}, first held ${number(body.low)}`;
      $("#tail-state").className = "muted";
    } else {
      $("#tail-state").textContent = body.error;
      $("#tail-state").className = "error";
    }
    renderTail();
  } catch (error) {
    $("#tail-state").textContent = `console unreachable: ${error}`;
    $("#tail-state").className = "error";
  }
  if (key === tail.key) tail.timer = setTimeout(readTail, 1000);
}

function renderTail() {
  const value = (v) => (typeof v === "string" ? v : JSON.stringify(v));
  $("#tail .body").innerHTML = tail.records.length
    ? table(
        [["seq", "num"], ["time"], ["key"], ["headers"], ["value"]],
        tail.records.map((r) => [
          cell(r.seq, "num"),
          cell(new Date(r.timestamp).toISOString().replace("T", " ").slice(0, 23)),
          cell(r.key ?? ""),
          cell(Object.entries(r.headers).map(([k, v]) => `${k}=${v}`).join(" ")),
          cell(value(r.value), "value"),
        ]),
        (i) => data("seq", tail.records[i].seq),
      )
    : `<p class="muted">${tail.key ? "no records yet" : ""}</p>`;
}

// --- live updates ------------------------------------------------------------------

function render(state) {
  actions = state.actions;
  $("#admin").hidden = !actions;
  renderProducers(state.producers);
  renderConsumers(state.producers);
  renderGroups(state.groups, state.databases);
  renderParked(state.parked);
  renderTailChoices(state.producers);
  const when = new Date(state.time).toLocaleTimeString();
  $("#updated").textContent = state.listing_error
    ? `updated ${when}; ${state.listing_error} (the last list is shown)`
    : `updated ${when}`;
  $("#updated").className = state.listing_error ? "error" : "muted";
  document.body.dataset.updated = state.time;
}

const events = new EventSource("/api/events");
events.onmessage = (event) => render(JSON.parse(event.data));
events.onerror = () => {
  $("#updated").textContent = "console unreachable: retrying";
  $("#updated").className = "error";
};
