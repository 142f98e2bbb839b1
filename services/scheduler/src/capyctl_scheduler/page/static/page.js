// CapyCTL's status page: live sections from the server's events, times shown relative to
// now, and a confirmation before each button acts. Without this script the page still
// works: reload to see changes, and each button asks on a page of its own.
"use strict";

const formKey = document.querySelector('meta[name="capyctl-form-key"]')?.content ?? "";

function ago(seconds) {
  const s = Math.abs(seconds);
  if (s < 1) return "just now";
  const text = s < 60 ? `${Math.round(s)} s` : s < 3600 ? `${Math.round(s / 60)} min`
    : s < 86400 ? `${(s / 3600).toFixed(1)} h` : `${(s / 86400).toFixed(1)} d`;
  return seconds >= 0 ? `${text} ago` : `in ${text}`;
}

function tick() {
  const now = Date.now() / 1000;
  for (const t of document.querySelectorAll("time[data-at]")) {
    t.title = t.dateTime;
    t.textContent = ago(now - Number(t.dataset.at));
  }
}

function notice(text) {
  const box = document.getElementById("notice");
  if (box) box.textContent = text;
}

function follow() {
  const live = document.getElementById("live");
  if (!live || !window.EventSource) return;
  const source = new EventSource("/events");
  source.addEventListener("open", () => {
    live.hidden = false; live.classList.remove("lost"); live.textContent = "live";
  });
  source.addEventListener("error", () => {
    live.classList.add("lost"); live.textContent = "reconnecting";
  });
  source.addEventListener("section", (event) => {
    const part = JSON.parse(event.data);
    const old = document.getElementById(part.id);
    if (old) { old.outerHTML = part.html; tick(); }
  });
  source.addEventListener("trouble", (event) => notice(JSON.parse(event.data)));
  // A logout (here or in another tab) or the session's expiry: back to the login form.
  source.addEventListener("ended", () => { source.close(); window.location.reload(); });
}

function randomKey() {
  const bytes = new Uint8Array(16);
  crypto.getRandomValues(bytes);
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

document.addEventListener("submit", async (event) => {
  const form = event.target;
  if (!form.classList.contains("act")) return;
  event.preventDefault();
  const button = form.querySelector("button");
  if (!window.confirm(button.dataset.confirm)) return;
  const body = new URLSearchParams(new FormData(form));
  body.set("form_key", formKey);
  body.set("key", randomKey());
  button.disabled = true;
  try {
    const answer = await fetch("/actions", {
      method: "POST", body, headers: { Accept: "application/json" }, credentials: "same-origin",
    });
    const found = await answer.json();
    notice(answer.ok ? `Asked: ${found.done} ${found.name}.`
      : `${found.error.code}: ${found.error.message}`);
  } catch (error) {
    notice(`The scheduler did not answer: ${error}`);
  } finally {
    button.disabled = false;
  }
});

tick();
setInterval(tick, 1000);
follow();
