// specdec playground: streams POST /v1/completions with speculative.steps and draws every step.
// No dependencies and nothing fetched from anywhere but this server.
"use strict";

(() => {
  const FALLBACK_POLICIES = ["fixed", "heuristic", "confidence", "adaptive"];
  const SVG = "http://www.w3.org/2000/svg";
  const VISIBLE = { " ": "·", "\n": "↵", "\t": "→", "\r": "␍" };
  const $ = (id) => document.getElementById(id);

  const ui = {
    form: $("run-form"), prompt: $("prompt"), model: $("model"), policy: $("policy"), tau: $("tau"),
    temperature: $("temperature"), maxTokens: $("max-tokens"), n: $("n"), samples: $("samples"),
    apiKey: $("api-key"), run: $("run"),
    stop: $("stop"), error: $("error"), info: $("server-info"), output: $("output"), echo: $("prompt-echo"),
    text: $("output-text"), steps: $("steps"), chartAccept: $("chart-accept"), chartSpeed: $("chart-speed"),
    stats: {
      alpha: $("stat-alpha"), length: $("stat-length"), passes: $("stat-passes"), tokens: $("stat-tokens"),
      speed: $("stat-speed"), finish: $("stat-finish"),
    },
  };

  // One run's state; replaced by a fresh object on every run.
  let run = null;
  let hasDrafter = true;
  let drawQueued = false;

  // -- helpers --------------------------------------------------------------------------------

  function visible(piece) {
    if (!piece) return "∅";
    let out = "";
    for (const ch of piece) {
      const code = ch.codePointAt(0);
      if (VISIBLE[ch]) out += VISIBLE[ch];
      else if (code < 0x20 || code === 0x7f) out += "\\x" + code.toString(16).padStart(2, "0");
      else out += ch;
    }
    return out;
  }

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function headers() {
    const h = { "Content-Type": "application/json" };
    if (ui.apiKey.value.trim()) h.Authorization = "Bearer " + ui.apiKey.value.trim();
    return h;
  }

  function setState(state) {
    document.body.dataset.state = state;
    const running = state === "running";
    ui.run.disabled = running;
    ui.stop.disabled = !running;
    ui.output.setAttribute("aria-busy", String(running));
  }

  function showError(message, field) {
    ui.error.textContent = message;
    ui.error.hidden = false;
    if (field) {
      field.setAttribute("aria-invalid", "true");
      const section = field.closest("details");
      if (section) section.open = true;  // a field in a closed section: show it
      field.focus();
    }
  }

  function clearError() {
    ui.error.hidden = true;
    ui.error.textContent = "";
    for (const f of [ui.prompt, ui.tau, ui.temperature, ui.maxTokens, ui.n, $("format-value")]) {
      f.removeAttribute("aria-invalid");
    }
  }

  async function errorMessage(response) {
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) return body.error.message;
    } catch (_) { /* not JSON: fall through to the status line */ }
    return `the server answered ${response.status} ${response.statusText}`;
  }

  // -- server info ----------------------------------------------------------------------------

  async function loadModels() {
    let models = [];
    try {
      const r = await fetch("/v1/models", { headers: headers() });
      if (r.status === 401) {
        ui.info.textContent = "this server needs an API key: open Connection below, enter it, then run";
        fillPolicies(FALLBACK_POLICIES);
        return;
      }
      if (!r.ok) throw new Error(await errorMessage(r));
      models = (await r.json()).data || [];
    } catch (e) {
      ui.info.textContent = "could not reach the server: " + e.message;
      fillPolicies(FALLBACK_POLICIES);
      return;
    }
    ui.model.replaceChildren(...models.map((m) => new Option(m.id, m.id)));
    const first = models[0] || {};
    hasDrafter = first.drafter !== null && first.drafter !== undefined;
    fillPolicies(Array.isArray(first.policies) && first.policies.length ? first.policies : FALLBACK_POLICIES);
    const drafter = hasDrafter ? `drafter: ${first.drafter}` : "no drafter (plain target decoding, τ = 0)";
    const ctx = first.max_context ? ` · context ${first.max_context} tokens` : "";
    ui.info.textContent = `serving ${first.id || "?"} · ${drafter}${ctx}`;
    if (!hasDrafter) {
      ui.tau.value = "0";
      ui.tau.max = "0";
    }
    syncTau();
  }

  function fillPolicies(names) {
    const current = ui.policy.value;
    ui.policy.replaceChildren(...names.map((n) => new Option(n, n)));
    if (names.includes(current)) ui.policy.value = current;
    syncTau();
  }

  function syncTau() {
    ui.tau.disabled = ui.policy.value !== "fixed" && ui.policy.value !== "";
  }

  // -- the request ----------------------------------------------------------------------------

  function readRequest() {
    const prompt = ui.prompt.value;
    if (!prompt) return showError("the prompt is empty", ui.prompt);
    const maxTokens = Number(ui.maxTokens.value);
    if (!Number.isInteger(maxTokens) || maxTokens < 1) {
      return showError("max tokens must be a whole number of at least 1", ui.maxTokens);
    }
    const temperature = Number(ui.temperature.value);
    if (ui.temperature.value.trim() === "" || !(temperature >= 0 && temperature <= 2)) {
      return showError("temperature must be a number from 0 to 2", ui.temperature);
    }
    const speculative = { policy: ui.policy.value || "fixed", steps: true };
    if (speculative.policy === "fixed") {
      const tau = Number(ui.tau.value);
      if (!Number.isInteger(tau) || tau < 0) return showError("τ must be a whole number of at least 0", ui.tau);
      if (tau > 0 && !hasDrafter) return showError("this server has no drafter: τ must be 0", ui.tau);
      speculative.tau = tau;
    }
    const n = Number(ui.n.value);
    if (!Number.isInteger(n) || n < 1 || n > 16) return showError("n must be a whole number from 1 to 16", ui.n);
    const body = { prompt, max_tokens: maxTokens, temperature, stream: true, speculative };
    if (n > 1) body.n = n;
    // Penalties and length: sent only when changed from their defaults; the server checks the ranges (400).
    for (const [id, key, off] of [["presence-penalty", "presence_penalty", 0], ["frequency-penalty",
      "frequency_penalty", 0], ["repetition-penalty", "repetition_penalty", 1], ["min-tokens", "min_tokens", 0]]) {
      const field = $(id);
      const value = Number(field.value);
      if (field.value.trim() === "" || !Number.isFinite(value)) return showError(`${key} must be a number`, field);
      if (value !== off) body[key] = value;
    }
    if ($("ignore-eos").checked) body.ignore_eos = true;
    if ($("want-logprobs").checked) body.logprobs = 3;
    const format = readFormat();
    if (format === null) return null;
    if (format) body.response_format = format;
    if (ui.model.value) body.model = ui.model.value;
    return body;
  }

  // The output format (response_format): undefined for free text, null after showing an error.
  function readFormat() {
    const kind = $("format-kind").value;
    const field = $("format-value");
    const value = field.value;
    if (kind === "text") return undefined;
    if (kind === "json_object") return { type: "json_object" };
    if (kind === "json_schema") {
      let schema;
      try {
        schema = JSON.parse(value);
      } catch (e) {
        showError(`the schema is not JSON: ${e.message}`, field);
        return null;
      }
      return { type: "json_schema", json_schema: { name: "playground", schema } };
    }
    if (kind === "regex") {
      if (!value.trim()) { showError("write the regular expression", field); return null; }
      return { type: "regex", regex: value };
    }
    const choices = value.split("\n").filter((c) => c !== "");
    if (!choices.length) { showError("write the choices, one a line", field); return null; }
    return { type: "choice", choice: choices };
  }

  async function start() {
    if (run && run.active) return;
    clearError();
    const body = readRequest();
    if (!body) return;
    run = { active: true, controller: new AbortController(), steps: [], tokens: 0, drafted: 0, accepted: 0,
            time: 0, speeds: [], summary: null, finish: null, samples: [] };
    ui.echo.textContent = body.prompt;
    ui.text.textContent = "";
    ui.samples.replaceChildren();
    for (let j = 1; j < (body.n || 1); j++) {
      const pre = el("pre", "output sample");
      pre.setAttribute("aria-label", `sample ${j}`);
      pre.append(el("span", "prompt-echo", `sample ${j}: `));
      run.samples[j] = pre.appendChild(el("span"));
      ui.samples.append(pre);
    }
    $("logprobs").replaceChildren();
    $("logprobs-box").hidden = !body.logprobs;
    ui.steps.replaceChildren();
    for (const dd of Object.values(ui.stats)) dd.textContent = "–";
    draw();
    setState("running");
    const mine = run;
    try {
      const r = await fetch("/v1/completions", {
        method: "POST", headers: headers(), body: JSON.stringify(body), signal: mine.controller.signal,
      });
      if (!r.ok) throw new Error(await errorMessage(r));
      await readStream(r.body, mine);
      if (mine.active) finish(mine, mine.finish ? "done" : "error");
      if (!mine.finish && !ui.error.textContent) showError("the stream ended before the request finished");
    } catch (e) {
      if (e.name === "AbortError") finish(mine, "stopped");
      else {
        finish(mine, "error");
        showError(e.message);
      }
    }
  }

  function stop() {
    if (run && run.active) run.controller.abort();
  }

  function finish(r, state) {
    if (!r.active) return;
    r.active = false;
    if (state === "stopped") ui.stats.finish.textContent = "stopped";
    setState(state);
  }

  async function readStream(stream, r) {
    const reader = stream.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        onChunk(JSON.parse(data), r);
      }
    }
  }

  function onChunk(chunk, r) {
    if (chunk.error) {
      showError(chunk.error.message || "the request failed");
      return;
    }
    const choice = (chunk.choices || [])[0];
    if (choice && choice.index > 0) {  // another of the n samples: its text only (steps and stats are sample 0's)
      if (choice.text && r.samples[choice.index]) r.samples[choice.index].append(choice.text);
      return;
    }
    if (choice && choice.text) ui.text.append(choice.text);
    if (choice && choice.logprobs) {
      const lp = choice.logprobs;
      lp.tokens.forEach((token, i) => {
        const alts = Object.entries(lp.top_logprobs[i] || {}).map(([t, v]) => `${visible(t)} ${v.toFixed(2)}`);
        const li = document.createElement("li");
        li.textContent = `${visible(token)}  ${lp.token_logprobs[i].toFixed(3)}   [${alts.join(", ")}]`;
        $("logprobs").append(li);
      });
    }
    const spec = chunk.speculative;
    if (spec && spec.step) addStep(spec.step, r);
    if (choice && choice.finish_reason) {
      r.finish = choice.finish_reason;
      r.summary = spec || null;
      ui.stats.finish.textContent = choice.finish_reason;
      updateStats(r);
    }
  }

  // -- steps ----------------------------------------------------------------------------------

  function addStep(step, r) {
    const emitted = step.emitted_pieces || [];
    const drafts = step.draft_pieces || [];
    const kept = Math.min(step.n_accepted, emitted.length);
    r.steps.push(step);
    r.tokens += emitted.length;
    r.drafted += step.tau;
    r.accepted += kept;
    r.time += (step.draft_time || 0) + (step.verify_time || 0) + (step.other_time || 0);
    r.speeds.push(r.time > 0 ? r.tokens / r.time : 0);

    const li = el("li", "step");
    li.dataset.correction = step.correction;
    const head = el("span", "step-head");
    head.append(el("span", "step-no", `#${step.step}`), el("span", "step-tau", `τ=${step.tau}`));
    const tokens = el("span", "tokens");
    const add = (node, kind, piece) => {
      node.className = `tok ${kind}`;
      node.textContent = visible(piece);
      node.title = `${kind}: ${JSON.stringify(piece)}`;
      tokens.append(node);
    };
    emitted.slice(0, kept).forEach((p) => add(el("span"), "accepted", p));
    drafts.slice(kept, step.n_accepted).forEach((p) => add(el("span"), "cut", p));
    drafts.slice(step.n_accepted).forEach((p) => add(el("del"), "rejected", p));
    const correction = emitted.length > step.n_accepted ? emitted[step.n_accepted] : null;
    if (correction !== null) add(el("ins"), step.correction, correction);
    const reason = el("span", "reason", step.reason || "");
    const rejected = Math.max(0, drafts.length - step.n_accepted);
    li.setAttribute("aria-label", `step ${step.step}, τ ${step.tau}: ${kept} accepted, ${rejected} rejected` +
      (correction !== null ? `, ${step.correction} token ${JSON.stringify(correction)}` : "") +
      (step.reason ? `; policy: ${step.reason}` : ""));
    li.append(head, tokens, reason);

    const list = ui.steps;
    const atBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 40;
    list.append(li);
    if (atBottom) list.scrollTop = list.scrollHeight;
    updateStats(r);
    if (!drawQueued) {
      drawQueued = true;
      requestAnimationFrame(() => { drawQueued = false; draw(); });
    }
  }

  function updateStats(r) {
    const s = r.summary;
    const alpha = s ? s.acceptance_rate : (r.drafted ? r.accepted / r.drafted : 0);
    const passes = s ? s.target_passes : r.steps.length;
    const length = s ? s.mean_accepted_length : (passes ? r.tokens / passes : 0);
    ui.stats.alpha.textContent = `${alpha.toFixed(2)} (${s ? s.accepted : r.accepted}/${s ? s.drafted : r.drafted})`;
    ui.stats.length.textContent = length.toFixed(2);
    ui.stats.passes.textContent = String(passes);
    ui.stats.tokens.textContent = String(r.tokens);
    ui.stats.speed.textContent = r.time > 0 ? (r.tokens / r.time).toFixed(1) : "–";
  }

  // -- charts ---------------------------------------------------------------------------------

  function draw() {
    drawAcceptance(run ? run.steps : []);
    drawSpeed(run ? run.speeds : []);
  }

  function drawAcceptance(steps) {
    const maxTau = steps.reduce((m, s) => Math.max(m, s.tau), 0);
    const W = 320, H = 140, pad = { l: 30, r: 8, t: 10, b: 24 };
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart-svg", "aria-hidden": "true" });
    axes(root, W, H, pad, ["0", "0.5", "1"]);
    const parts = [];
    const slot = (W - pad.l - pad.r) / Math.max(maxTau, 1);
    for (let k = 1; k <= maxTau; k++) {
      const drafted = steps.filter((s) => s.tau >= k);
      const rate = drafted.filter((s) => s.n_accepted >= k).length / drafted.length;
      const h = rate * (H - pad.t - pad.b);
      const x = pad.l + (k - 1) * slot + slot * 0.15;
      const bar = svg("rect", { x, y: H - pad.b - h, width: slot * 0.7, height: Math.max(h, 0.5), class: "bar" });
      bar.append(svg("title", {}, `position ${k}: ${(rate * 100).toFixed(0)}% of ${drafted.length} steps`));
      const label = svg("text", { x: x + slot * 0.35, y: Math.max(H - pad.b - h - 3, pad.t + 8), class: "value",
                                  "text-anchor": "middle" }, `${(rate * 100).toFixed(0)}%`);
      root.append(bar, label, svg("text", { x: x + slot * 0.35, y: H - 8, class: "tick", "text-anchor": "middle" }, k));
      parts.push(`position ${k} ${(rate * 100).toFixed(0)}%`);
    }
    if (!maxTau) root.append(svg("text", { x: W / 2, y: H / 2, class: "empty", "text-anchor": "middle" }, "no drafts yet"));
    ui.chartAccept.replaceChildren(root);
    ui.chartAccept.setAttribute("aria-label", "acceptance by draft position: " + (parts.join(", ") || "no data yet"));
  }

  function drawSpeed(speeds) {
    const W = 320, H = 140, pad = { l: 30, r: 8, t: 10, b: 24 };
    const top = Math.max(1, ...speeds) * 1.1;
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart-svg", "aria-hidden": "true" });
    axes(root, W, H, pad, ["0", (top / 2).toFixed(0), top.toFixed(0)]);
    if (speeds.length) {
      const dx = (W - pad.l - pad.r) / Math.max(speeds.length - 1, 1);
      const pts = speeds.map((v, i) => `${(pad.l + i * dx).toFixed(1)},${(H - pad.b - (v / top) * (H - pad.t - pad.b)).toFixed(1)}`);
      root.append(svg("polyline", { points: pts.join(" "), class: "line" }));
      root.append(svg("text", { x: W - pad.r, y: H - 8, class: "tick", "text-anchor": "end" }, `step ${speeds.length - 1}`));
    } else {
      root.append(svg("text", { x: W / 2, y: H / 2, class: "empty", "text-anchor": "middle" }, "no steps yet"));
    }
    ui.chartSpeed.replaceChildren(root);
    const last = speeds.length ? speeds[speeds.length - 1].toFixed(1) : null;
    ui.chartSpeed.setAttribute("aria-label", last ? `tokens per second: ${last} after ${speeds.length} steps` : "tokens per second: no data yet");
  }

  function axes(root, W, H, pad, labels) {
    labels.forEach((label, i) => {
      const y = H - pad.b - (i / (labels.length - 1)) * (H - pad.t - pad.b);
      root.append(svg("line", { x1: pad.l, x2: W - pad.r, y1: y, y2: y, class: i ? "grid" : "axis" }));
      root.append(svg("text", { x: pad.l - 4, y: y + 3, class: "tick", "text-anchor": "end" }, label));
    });
  }

  // -- wiring ---------------------------------------------------------------------------------

  ui.form.addEventListener("submit", (e) => { e.preventDefault(); start(); });
  ui.stop.addEventListener("click", stop);
  ui.policy.addEventListener("change", syncTau);
  ui.apiKey.addEventListener("change", loadModels);
  document.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      start();
    } else if (e.key === "Escape" && run && run.active) {
      stop();
    }
  });
  setState("idle");
  draw();
  loadModels();
})();
