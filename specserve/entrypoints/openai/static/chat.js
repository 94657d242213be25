// specserve chat page: a conversation over POST /v1/chat/completions (streamed),
// each answer token coloured by how speculative decoding produced it.
// Plain JavaScript, no build step, nothing fetched from elsewhere. Model text is
// only ever inserted with textContent.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const SOURCES = ["accepted", "recovered", "bonus", "plain"];
  const KEY_STORE = "specserve.chat.apiKey";

  const el = {
    messages: $("messages"), empty: $("empty"), error: $("error"), composer: $("composer"),
    prompt: $("prompt"), send: $("send"), stop: $("stop"), clear: $("clear"),
    temperature: $("temperature"), topP: $("top-p"), maxTokens: $("max-tokens"),
    apiKey: $("api-key"), rememberKey: $("remember-key"),
  };

  const state = {
    history: [],        // [{role, content}] sent with every request
    controller: null,   // AbortController of the request in flight
    current: null,      // the Answer being streamed (or the last one)
  };

  // ------------------------------------------------------------------ settings
  try {
    const saved = window.localStorage.getItem(KEY_STORE);
    if (saved) { el.apiKey.value = saved; el.rememberKey.checked = true; }
  } catch (e) { /* storage unavailable: the key lives in the page only */ }

  function storeKey() {
    try {
      if (el.rememberKey.checked && el.apiKey.value) window.localStorage.setItem(KEY_STORE, el.apiKey.value);
      else window.localStorage.removeItem(KEY_STORE);
    } catch (e) { /* ignore */ }
  }
  el.apiKey.addEventListener("change", () => { storeKey(); loadInfo(); });
  el.rememberKey.addEventListener("change", storeKey);

  function authHeaders(extra) {
    const h = Object.assign({}, extra || {});
    const key = el.apiKey.value.trim();
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  function readNumber(input, name, check, integer) {
    const raw = input.value.trim();
    if (raw === "") return undefined;   // not sent: the server's default
    const v = Number(raw);
    if (!Number.isFinite(v) || (integer && !Number.isInteger(v)) || !check(v)) {
      throw new Error(`${name}: ${JSON.stringify(raw)} is not valid`);
    }
    return v;
  }

  function readSettings() {
    const body = {};
    const t = readNumber(el.temperature, "temperature", (v) => v >= 0, false);
    const p = readNumber(el.topP, "top-p", (v) => v > 0 && v <= 1, false);
    const m = readNumber(el.maxTokens, "max tokens", (v) => v >= 1, true);
    if (t !== undefined) body.temperature = t;
    if (p !== undefined) body.top_p = p;
    if (m !== undefined) body.max_tokens = m;
    return body;
  }

  // -------------------------------------------------------------------- errors
  function showError(message) {
    el.error.textContent = message;
    el.error.hidden = false;
  }

  function clearError() {
    el.error.textContent = "";
    el.error.hidden = true;
  }

  async function errorMessage(response) {
    let text = "";
    try { text = await response.text(); } catch (e) { /* ignore */ }
    try {
      const body = JSON.parse(text);
      if (body && body.error) {
        return typeof body.error === "string" ? body.error : (body.error.message || JSON.stringify(body.error));
      }
    } catch (e) { /* not JSON */ }
    return `HTTP ${response.status} ${response.statusText}` + (text ? `: ${text.slice(0, 300)}` : "");
  }

  class ServerError extends Error {}

  // ------------------------------------------------------------ server config
  function setText(id, text) { $(id).textContent = text; }

  async function loadInfo() {
    try {
      const r = await fetch("/v1/specserve/info", { headers: authHeaders() });
      if (!r.ok) {
        const why = r.status === 401 ? "API key needed" : await errorMessage(r);
        showInfo(null, why);
        return;
      }
      showInfo(await r.json());
    } catch (e) {
      showInfo(null, String(e));
    }
  }

  function showInfo(info, problem) {
    if (!info) {
      setText("server-model", "?");
      setText("server-proposer", `? (${problem})`);
      setText("server-k", "?");
      setText("server-max-len", "?");
      return;
    }
    setText("server-model", String(info.model));
    setText("server-max-len", info.max_model_len != null ? String(info.max_model_len) : "?");
    const spec = info.speculative;
    if (!spec) {
      setText("server-proposer", "none (speculation off)");
      setText("server-k", "0");
    } else {
      setText("server-proposer", spec.method + (spec.draft_model ? ` (${spec.draft_model})` : ""));
      setText("server-k", String(spec.num_speculative_tokens) + (spec.dynamic_k ? " (dynamic)" : ""));
    }
  }

  // ------------------------------------------------------------------ messages
  function nearBottom() {
    const m = el.messages;
    return m.scrollHeight - m.scrollTop - m.clientHeight < 60;
  }

  function scrollDown(force) {
    if (force || nearBottom()) el.messages.scrollTop = el.messages.scrollHeight;
  }

  function addMessage(role, text) {
    el.empty.hidden = true;
    const div = document.createElement("div");
    div.className = `msg msg-${role}`;
    const who = document.createElement("div");
    who.className = "role";
    who.textContent = role;
    const content = document.createElement("div");
    content.className = "content";
    if (text) content.textContent = text;
    const meta = document.createElement("div");
    meta.className = "meta";
    div.append(who, content, meta);
    el.messages.append(div);
    scrollDown(true);
    return { div, content, meta };
  }

  // ---------------------------------------------------------------- one answer
  const fmt = (x, digits) => (typeof x === "number" && Number.isFinite(x) ? x.toFixed(digits) : "–");
  const pct = (x) => (typeof x === "number" && Number.isFinite(x) ? (100 * x).toFixed(1) + "%" : "–");

  class Answer {
    constructor(view) {
      this.view = view;
      this.t0 = performance.now();
      this.tFirst = null;
      this.tEnd = null;
      this.numTokens = 0;
      this.counts = { accepted: 0, recovered: 0, bonus: 0, plain: 0 };
      this.lastSource = null;
      this.content = "";          // the answer's text as the server sent it (history)
      this.sawProvenance = false;
      this.stats = null;          // the server's stats, from the final chunk
      this.finishReason = null;
    }

    onChunk(obj) {
      for (const choice of obj.choices || []) {
        if ((choice.index || 0) !== 0) continue;
        const delta = choice.delta || {};
        const spec = choice.specserve;
        if (typeof delta.content === "string") this.content += delta.content;
        if (spec && Array.isArray(spec.tokens)) {
          this.sawProvenance = true;
          this.addTokens(spec.tokens);
        } else if (delta.content) {
          this.addUntagged(delta.content);   // a server without provenance
        }
        if (spec && spec.stats) this.stats = spec.stats;
        if (choice.finish_reason) this.finishReason = choice.finish_reason;
      }
    }

    addTokens(tokens) {
      if (!tokens.length) return;
      const stick = nearBottom();
      const frag = document.createDocumentFragment();
      for (const t of tokens) {
        const source = SOURCES.includes(t.source) ? t.source : "unknown";
        const span = document.createElement("span");
        span.className = `tok tok-${source}`;
        span.textContent = typeof t.text === "string" ? t.text : "";
        span.title = `${source}, token id ${t.id}`;
        frag.append(span);
        if (source in this.counts) this.counts[source] += 1;
        this.numTokens += 1;
        this.lastSource = source;
      }
      if (this.tFirst === null) this.tFirst = performance.now();
      this.view.content.append(frag);
      scrollDown(stick);
    }

    addUntagged(text) {
      const stick = nearBottom();
      const span = document.createElement("span");
      span.className = "tok";
      span.textContent = text;
      this.view.content.append(span);
      if (this.tFirst === null) this.tFirst = performance.now();
      scrollDown(stick);
    }

    // Live figures from the token sources. A verification step emits its
    // accepted drafts followed by exactly one recovered, bonus or plain token;
    // a trailing run of accepted tokens (cut by max_tokens or a stop) is one more.
    live() {
      const c = this.counts;
      const steps = c.recovered + c.bonus + c.plain + (this.lastSource === "accepted" ? 1 : 0);
      return {
        acceptedShare: this.numTokens ? c.accepted / this.numTokens : NaN,
        tokensPerStep: steps ? this.numTokens / steps : NaN,
      };
    }

    finish(outcome) {
      this.tEnd = performance.now();
      this.outcome = outcome;
      const div = this.view.div;
      div.classList.remove("streaming");
      div.classList.add("done");
      if (outcome !== "done") div.classList.add(outcome);
      div.dataset.outcome = outcome;
      div.dataset.finishReason = this.finishReason || "";
      const parts = [`${this.numTokens} tokens`, `${fmt(this.tokensPerSecond(), 1)} tokens/s`];
      if (this.stats) {
        parts.push(`acceptance ${pct(this.stats.acceptance_rate)}`, `τ ${fmt(this.stats.mean_acceptance_length, 2)}`);
      } else if (this.numTokens) {
        const l = this.live();
        parts.push(`accepted share ${pct(l.acceptedShare)}`, `${fmt(l.tokensPerStep, 2)} tokens/step`);
      }
      if (outcome === "stopped") parts.push("stopped");
      else if (this.finishReason) parts.push(`finish: ${this.finishReason}`);
      this.view.meta.textContent = parts.join(" · ");
    }

    elapsed(from) {
      const end = this.tEnd !== null ? this.tEnd : performance.now();
      return (end - from) / 1000;
    }

    tokensPerSecond() {
      const s = this.elapsed(this.t0);
      return this.numTokens && s > 0 ? this.numTokens / s : NaN;
    }

    decodeTokensPerSecond() {
      if (this.tFirst === null || this.numTokens < 2) return NaN;
      const s = this.elapsed(this.tFirst);
      return s > 0 ? (this.numTokens - 1) / s : NaN;
    }
  }

  // --------------------------------------------------------------- the figures
  function resetStats() {
    for (const id of ["stat-tokens", "stat-tps", "stat-tps-decode", "stat-ttft", "stat-acceptance", "stat-tau",
      "stat-sources", "stat-drafts", "stat-by-position"]) setText(id, "–");
    setText("stat-origin", "(no answer yet)");
    $("stat-origin").classList.remove("final");
    setText("stat-acceptance-label", "accepted share (live)");
    setText("stat-tau-label", "tokens/step (live)");
  }

  function renderStats(a) {
    if (!a) return;
    const c = a.counts;
    setText("stat-tokens", String(a.numTokens));
    setText("stat-tps", fmt(a.tokensPerSecond(), 1));
    setText("stat-tps-decode", fmt(a.decodeTokensPerSecond(), 1));
    setText("stat-ttft", a.tFirst !== null ? `${((a.tFirst - a.t0) / 1000).toFixed(2)} s` : "–");
    const sources = $("stat-sources");
    sources.replaceChildren();
    for (const source of SOURCES) {
      const chip = document.createElement("span");
      chip.className = `chip tok-${source}`;
      chip.textContent = `${c[source]} ${source}`;
      sources.append(chip, " ");
    }
    const origin = $("stat-origin");
    const s = a.stats;
    if (s) {
      origin.textContent = "(final: the server's stats)";
      origin.classList.add("final");
      setText("stat-acceptance-label", "acceptance rate");
      setText("stat-tau-label", "τ (tokens/step)");
      setText("stat-acceptance", pct(s.acceptance_rate));
      setText("stat-tau", fmt(s.mean_acceptance_length, 2));
      setText("stat-drafts", `${s.num_accepted_tokens} of ${s.num_draft_tokens} draft tokens accepted; ` +
        `${s.num_drafts} drafts in ${s.num_steps} steps`);
      const byPos = Array.isArray(s.acceptance_by_position) ? s.acceptance_by_position : [];
      setText("stat-by-position", byPos.length ? byPos.map(pct).join(" ") : "–");
    } else {
      const l = a.live();
      origin.textContent = a.sawProvenance || !a.numTokens ? "(live, from the token sources)" : "(no token sources from the server)";
      origin.classList.remove("final");
      setText("stat-acceptance-label", "accepted share (live)");
      setText("stat-tau-label", "tokens/step (live)");
      setText("stat-acceptance", pct(l.acceptedShare));
      setText("stat-tau", fmt(l.tokensPerStep, 2));
    }
  }

  // ------------------------------------------------------------- SSE over fetch
  // Calls onData(payload) for each event's data; stops when onData returns false.
  async function readSSE(body, onData) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    let data = [];
    const dispatch = () => {
      if (!data.length) return true;
      const payload = data.join("\n");
      data = [];
      return onData(payload) !== false;
    };
    const line = (text) => {
      if (text.endsWith("\r")) text = text.slice(0, -1);
      if (text === "") return dispatch();
      if (text.startsWith(":")) return true;            // a comment
      const colon = text.indexOf(":");
      const field = colon < 0 ? text : text.slice(0, colon);
      let value = colon < 0 ? "" : text.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (field === "data") data.push(value);
      return true;
    };
    let finished = false;
    try {
      for (;;) {
        const { value, done } = await reader.read();
        buf += done ? decoder.decode() : decoder.decode(value, { stream: true });
        let nl;
        while ((nl = buf.indexOf("\n")) >= 0) {   // a line may span several reads
          const text = buf.slice(0, nl);
          buf = buf.slice(nl + 1);
          if (!line(text)) return;
        }
        if (done) {
          finished = true;
          if (buf) line(buf);
          dispatch();
          return;
        }
      }
    } finally {
      if (!finished) reader.cancel().catch(() => {});   // [DONE], an error event, or a throw
    }
  }

  // ---------------------------------------------------------------- one turn
  function setBusy(busy) {
    el.send.disabled = busy;
    el.stop.disabled = !busy;
    el.clear.disabled = busy;
    document.body.dataset.state = busy ? "streaming" : "idle";
  }

  async function send() {
    if (state.controller) return;
    const text = el.prompt.value;
    if (!text.trim()) return;
    let settings;
    try { settings = readSettings(); } catch (e) { showError(e.message); return; }
    clearError();

    state.history.push({ role: "user", content: text });
    const userView = addMessage("user", text);
    el.prompt.value = "";
    const view = addMessage("assistant");
    view.div.classList.add("streaming");
    const answer = new Answer(view);
    state.current = answer;
    resetStats();
    renderStats(answer);

    const controller = new AbortController();
    state.controller = controller;
    setBusy(true);
    const timer = window.setInterval(() => renderStats(answer), 250);
    let outcome = "done";
    try {
      const body = Object.assign({ messages: state.history, stream: true, specserve: { provenance: true } }, settings);
      const r = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: authHeaders({ "Content-Type": "application/json" }),
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!r.ok) throw new ServerError(await errorMessage(r));
      await readSSE(r.body, (payload) => {
        if (payload === "[DONE]") return false;
        let obj;
        try { obj = JSON.parse(payload); } catch (e) { throw new ServerError(`unreadable event from the server: ${payload.slice(0, 200)}`); }
        if (obj && obj.error) {
          throw new ServerError(typeof obj.error === "string" ? obj.error : (obj.error.message || JSON.stringify(obj.error)));
        }
        answer.onChunk(obj);
        renderStats(answer);
        return true;
      });
      if (!answer.finishReason) throw new ServerError("the stream ended before the answer finished");
    } catch (e) {
      if (e && e.name === "AbortError") {
        outcome = "stopped";
      } else {
        outcome = "failed";
        showError(e instanceof ServerError ? e.message : `request failed: ${e && e.message ? e.message : e}`);
      }
    } finally {
      window.clearInterval(timer);
      state.controller = null;
      answer.finish(outcome);
      renderStats(answer);
      setBusy(false);
    }

    if (answer.content || answer.numTokens) {
      // What was shown stays in the conversation (a stopped answer as far as it got).
      state.history.push({ role: "assistant", content: answer.content });
    } else {
      // Nothing came back: take the turn out again and give the text back.
      state.history.pop();
      userView.div.remove();
      view.div.remove();
      if (!el.prompt.value) el.prompt.value = text;
      if (!state.history.length) el.empty.hidden = false;
    }
    el.prompt.focus();
  }

  function newChat() {
    if (state.controller) return;
    state.history = [];
    state.current = null;
    for (const m of Array.from(el.messages.querySelectorAll(".msg"))) m.remove();
    el.empty.hidden = false;
    clearError();
    resetStats();
    el.prompt.focus();
  }

  el.composer.addEventListener("submit", (e) => { e.preventDefault(); send(); });
  el.prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
  });
  el.stop.addEventListener("click", () => { if (state.controller) state.controller.abort(); });
  el.clear.addEventListener("click", newChat);

  setBusy(false);
  resetStats();
  loadInfo();
})();
