// pgflow dashboard: the live parts only. Every page reads without this script; with it, the overview
// and a workflow's state are replaced by the fragments the server sends (already escaped HTML made on
// the server), and each stream grows as it is written. Chunks are set as text, never as HTML.
"use strict";

function live(url, handlers) {
  const source = new EventSource(url);
  for (const [name, handler] of Object.entries(handlers)) {
    source.addEventListener(name, (event) => handler(event, source));
  }
  return source;
}

function overview() {
  const box = document.getElementById("overview");
  if (!box || !box.dataset.live) return;
  live(box.dataset.live, {
    overview: (event) => {
      box.innerHTML = JSON.parse(event.data);
      box.dataset.updated = String(Date.now());
    },
  });
}

function workflowState() {
  const box = document.getElementById("state");
  if (!box || !box.dataset.live) return;
  live(box.dataset.live, {
    state: (event) => {
      const data = JSON.parse(event.data);
      box.innerHTML = data.html;
      box.dataset.status = data.status;
      box.dataset.updated = String(Date.now());
      const known = box.dataset.streams || "";
      if (data.streams.join(",") !== known) window.location.reload();  // a new stream: its box
      document.querySelectorAll("[data-when-status]").forEach((el) => {
        el.hidden = !el.dataset.whenStatus.split(",").includes(data.status);
      });
    },
    gone: (event, source) => source.close(),
  });
}

function streams() {
  document.querySelectorAll(".stream[data-src]").forEach((box) => {
    const list = box.querySelector("ol");
    const length = box.querySelector(".length");
    const state = box.querySelector(".state");
    const url = box.dataset.src + "&from=" + encodeURIComponent(box.dataset.next || "0");
    live(url, {
      message: (event) => {
        const position = Number(event.lastEventId);
        if (position < Number(box.dataset.next || "0")) return;  // already shown
        const item = document.createElement("li");
        item.dataset.pos = String(position);
        item.textContent = JSON.parse(event.data);
        list.appendChild(item);
        box.dataset.next = String(position + 1);
        length.textContent = (position + 1).toLocaleString("en") + " chunks";
      },
      end: (event, source) => {
        source.close();
        box.dataset.done = "true";
        state.textContent = "ended";  // closed, or its workflow ended
      },
    });
  });
}

document.addEventListener("DOMContentLoaded", () => {
  overview();
  workflowState();
  streams();
});
