"""The dashboard's only JavaScript: live list updates and the usage chart.

Constants, never formatted with data: what a script needs (a sandbox's
URL) it reads from an element's data- attribute, which render.py escaped.
"""

from __future__ import annotations

import base64
import hashlib

from corral.dashboard.render import STYLE, Safe

# The list page: state changes from the event stream update their row in
# place; anything else (a new sandbox, a row on another page) shows a hint
# to reload. A server without /v1/events answers 404, EventSource gives up
# (readyState CLOSED) and the page stays as it was rendered.
LIVE = """
(function () {
  var hint = document.getElementById('live-hint');
  if (!hint || !window.EventSource) return;
  var pending = 0, es;
  try { es = new EventSource(hint.dataset.events); } catch (e) { return; }
  es.onmessage = function (m) {
    var e;
    try { e = JSON.parse(m.data); } catch (err) { return; }
    if (e.kind === 'state' && e.sandbox) {
      var row = null, rows = document.querySelectorAll('tr[data-sandbox]');
      for (var i = 0; i < rows.length; i++) {
        if (rows[i].dataset.sandbox === e.sandbox) { row = rows[i]; break; }
      }
      if (row) {
        var badge = row.querySelector('.state .badge');
        badge.textContent = e.state;
        badge.className = 'badge live';
        return;
      }
    }
    pending++;
    hint.textContent = pending + ' new events, refresh';
    hint.style.display = 'block';
  };
  es.onerror = function () { if (es.readyState === 2) es.close(); };
})();
"""

# The detail page: usage every 2 s, memory (% of its limit) and CPU (% of
# what it may use, from cpu_seconds between two readings) as an SVG line.
# A closed sandbox has no usage: the first error stops the polling.
USAGE = """
(function () {
  var box = document.getElementById('usage');
  if (!box) return;
  var NS = 'http://www.w3.org/2000/svg', W = 640, H = 140, KEEP = 90;
  var samples = [], last = null, timer = null;
  var now = document.createElement('p'); now.id = 'usage-now'; box.appendChild(now);
  var svg = document.createElementNS(NS, 'svg');
  svg.setAttribute('width', W); svg.setAttribute('height', H); box.appendChild(svg);
  function line(key, colour) {
    var pl = document.createElementNS(NS, 'polyline');
    pl.setAttribute('fill', 'none'); pl.setAttribute('stroke', colour);
    pl.setAttribute('points', samples.map(function (s, i) {
      return (i * (W / KEEP)).toFixed(1) + ',' + (H - 10 - s[key] * (H - 20) / 100).toFixed(1);
    }).join(' '));
    svg.appendChild(pl);
  }
  function draw() {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    line('mem', '#2563eb'); line('cpu', '#dc2626');
  }
  function poll() {
    fetch(box.dataset.url, {credentials: 'same-origin'}).then(function (r) {
      if (!r.ok) throw new Error(r.status);
      return r.json();
    }).then(function (u) {
      var cpu = 0;
      if (last && u.at > last.at) {
        cpu = 100 * (u.cpu_seconds - last.cpu_seconds) / ((u.at - last.at) * (u.cpu || 1));
      }
      last = u;
      var mem = u.memory_limit ? 100 * u.memory_used / u.memory_limit : 0;
      samples.push({mem: mem, cpu: Math.max(0, Math.min(100, cpu))});
      if (samples.length > KEEP) samples.shift();
      now.textContent = 'memory ' + (u.memory_used / 1048576).toFixed(1) + ' MiB (' +
        mem.toFixed(1) + '%, blue) · cpu ' + cpu.toFixed(1) + '% (red) · pids ' + u.pids;
      draw();
    }).catch(function (err) {
      now.textContent = 'no usage (' + err.message + ')';
      clearInterval(timer);
    });
  }
  poll(); timer = setInterval(poll, 2000);
})();
"""


def _hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


# What a page may run and load: these scripts and the page's style, by
# hash; its own origin for fetches, the event stream and screenshots.
PAGE_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; "
        f"script-src {_hash(LIVE)} {_hash(USAGE)}; "
        f"style-src {_hash(STYLE)}; "
        "img-src 'self'; connect-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "x-frame-options": "DENY",
    "cache-control": "no-store",
    "referrer-policy": "same-origin",
}


def script(body: str) -> Safe:
    assert "</" not in body, "a script constant may not close its element"
    return Safe(f"<script>{body}</script>")
