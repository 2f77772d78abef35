// charstream web client: WebRTC receive (video + audio), microphone send, timing reports.
// Data channel "timing" (protocol in stages/egress/timing.py): answer pings, report each presented
// video frame (requestVideoFrameCallback: RTP timestamp + presentation time, a few a message), show turn latencies.
// The page also times its own microphone (an AudioWorklet level meter on the page's clock): each
// end of speech it hears is kept in state.micSpeechEnds, and each turn gets pageTotalMs, the
// user-experienced latency as the page saw it (its own end of speech -> the first speaking frame).
"use strict";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
// The key never sits in a URL: the printed link carries a one-time code, traded here for the key
// (kept for this tab only), and the code leaves the address bar and history at once.
const KEY = "charstream-key";
const keyReady = (async () => {
  const code = params.get("code");
  if (!code) return;
  params.delete("code");
  history.replaceState(null, "", location.pathname + (params.size ? `?${params}` : ""));
  const { key } = await postJSON("/code", { code });
  sessionStorage.setItem(KEY, key);
})();
const state = { status: "idle", framesReported: 0, pings: 0, turns: [], micSent: false, error: null,
                micSpeechEnds: [] };
window.charstream = state; // read by tests and for debugging

let pc = null, channel = null, token = null, micTrack = null, events = null, micMeter = null;

// The last sample above -40 dBFS (the benchmarks' definition of the end of speech) once 300 ms of
// quiet follow it; currentTime is the first sample of the 128-sample block being processed.
const METER = `registerProcessor("mic-meter", class extends AudioWorkletProcessor {
  constructor() { super(); this.lastLoud = null; }
  process(inputs) {
    const x = inputs[0] && inputs[0][0];
    if (x) {
      for (let i = x.length - 1; i >= 0; i--) {
        if (Math.abs(x[i]) > 0.01) { this.lastLoud = currentTime + (i + 1) / sampleRate; break; }
      }
      if (this.lastLoud !== null && currentTime - this.lastLoud > 0.3) {
        this.port.postMessage({ end: this.lastLoud, now: currentTime + x.length / sampleRate });
        this.lastLoud = null;
      }
    }
    return true;
  }
});`;

async function meterMicrophone(stream) {
  const ctx = new AudioContext();
  await ctx.audioWorklet.addModule(URL.createObjectURL(new Blob([METER], { type: "text/javascript" })));
  const node = new AudioWorkletNode(ctx, "mic-meter");
  // context time -> page clock: the block that ends at msg.now was processed just before this message
  node.port.onmessage = ({ data }) => {
    const endMs = wallMs() - (data.now - data.end) * 1000;
    state.micSpeechEnds.push(endMs);
    if (state.micSpeechEnds.length > 64) state.micSpeechEnds.shift();
  };
  ctx.createMediaStreamSource(stream).connect(node);
  return ctx;
}

function setStatus(text) { state.status = text; $("status").textContent = text; }
const wallMs = () => performance.timeOrigin + performance.now();

async function postJSON(path, body, headers = {}) {
  const r = await fetch(path, { method: "POST", headers: { "Content-Type": "application/json", ...headers },
                               body: JSON.stringify(body) });
  const data = await r.json().catch(() => ({ error: `HTTP ${r.status}` }));
  if (!r.ok) throw new Error(data.error || `HTTP ${r.status}`);
  return data;
}

const FRAMES_PER_REPORT = 6;  // stages/egress/timing.py: a quarter of a second of presented frames a message

function send(msg) { if (channel && channel.readyState === "open") channel.send(JSON.stringify(msg)); }

function onMessage(event) {
  let msg;
  try { msg = JSON.parse(event.data); } catch { return; }
  if (msg.type === "ping") {
    send({ type: "pong", id: msg.id, server_ms: msg.server_ms, client_ms: wallMs() });
    state.pings += 1;
  } else if (msg.type === "turn") {
    const presented = msg.client_first_speaking_frame_ms;
    const ends = state.micSpeechEnds.filter((t) => presented !== undefined && t < presented);
    if (ends.length) msg.pageTotalMs = presented - ends[ends.length - 1];
    state.turns.push(msg);
    if (state.turns.length > 256) state.turns.shift();
    showTurn(msg);
  } else if (msg.type === "end") {
    state.error = msg.reason;
    setStatus(`ended: ${msg.reason}`);
  }
}

// A fleet's front door streams the session's end: how the page hears that its node is gone.
function watchEvents(path) {
  events = new EventSource(path);
  events.onmessage = (event) => {
    const msg = JSON.parse(event.data);
    if (msg.type !== "end") return;
    state.error = msg.reason;
    setStatus(`ended: ${msg.reason}`);
    disconnect();
  };
}

function showTurn(msg) {
  const rows = Object.entries(msg.segments_ms)
    .map(([name, ms]) => `<tr><td>${name}</td><td>${Math.round(ms)} ms</td></tr>`).join("");
  $("segments").innerHTML = `<tr><td>turn</td><td>${msg.turn_id}</td></tr>` + rows;
  $("overlay").hidden = false;
}

function watchFrames(video) {
  if (!("requestVideoFrameCallback" in HTMLVideoElement.prototype)) {
    setStatus("connected (no requestVideoFrameCallback: no timing reports)");
    return;
  }
  let presented = [];  // [rtp, presented_ms] not sent yet: FRAMES_PER_REPORT a message, as the server expects
  const onFrame = (now, meta) => {
    if (meta.rtpTimestamp !== undefined) {
      presented.push([meta.rtpTimestamp, performance.timeOrigin + meta.presentationTime]);
      state.framesReported += 1;
      if (presented.length >= FRAMES_PER_REPORT) {
        send({ type: "frames", frames: presented });
        presented = [];
      }
    }
    if (pc) video.requestVideoFrameCallback(onFrame);
  };
  video.requestVideoFrameCallback(onFrame);
}

async function connect() {
  $("connect").disabled = true;
  setStatus("connecting");
  try {
    token = params.get("token");
    if (!token) {
      await keyReady;
      const key = sessionStorage.getItem(KEY) || window.prompt("server key") || "";
      const session = await postJSON("/session", {}, { "X-Charstream-Key": key });
      token = session.token;
      if (session.events) watchEvents(session.events);
    }
    pc = new RTCPeerConnection();
    pc.addTransceiver("video", { direction: "recvonly" });
    try {
      const mic = await navigator.mediaDevices.getUserMedia({ audio: { echoCancellation: true } });
      micTrack = mic.getAudioTracks()[0];
      pc.addTransceiver(micTrack, { direction: "sendrecv" });
      micMeter = await meterMicrophone(mic).catch((err) => { console.warn("no mic meter:", err); return null; });
      state.micSent = true;
      $("mic").disabled = false;
    } catch (err) {
      console.warn("no microphone:", err);
      pc.addTransceiver("audio", { direction: "recvonly" });
    }
    channel = pc.createDataChannel("timing");
    channel.onmessage = onMessage;
    channel.onopen = () => send({ type: "hello", agent: navigator.userAgent });
    const video = $("video");
    const stream = new MediaStream();
    pc.ontrack = (event) => { stream.addTrack(event.track); video.srcObject = stream; };
    pc.onconnectionstatechange = () => {
      setStatus(pc ? pc.connectionState : "closed");
      if (pc && (pc.connectionState === "failed" || pc.connectionState === "closed")) disconnect();
    };
    await pc.setLocalDescription(await pc.createOffer());
    await new Promise((resolve) => {  // no trickle ICE: send the offer with all candidates
      if (pc.iceGatheringState === "complete") return resolve();
      pc.addEventListener("icegatheringstatechange", () => pc.iceGatheringState === "complete" && resolve());
    });
    const answer = await postJSON("/offer", { token, sdp: pc.localDescription.sdp, type: "offer" });
    state.sessionId = answer.session_id;
    await pc.setRemoteDescription(answer);
    watchFrames(video);
    $("disconnect").disabled = false;
  } catch (err) {
    state.error = String(err);
    setStatus(`error: ${err.message || err}`);
    await disconnect();
  }
}

async function disconnect() {
  const closing = pc;
  pc = null;
  if (closing) closing.close();
  if (micTrack) { micTrack.stop(); micTrack = null; }
  if (events) { events.close(); events = null; }
  if (micMeter) { micMeter.close(); micMeter = null; }
  if (token && closing) postJSON("/hangup", { token }).catch(() => {});
  token = null;
  $("connect").disabled = false;
  $("disconnect").disabled = true;
  $("mic").disabled = true;
  if (!state.error) setStatus("disconnected");
}

function toggleMic() {
  if (!micTrack) return;
  micTrack.enabled = !micTrack.enabled;
  $("mic").textContent = micTrack.enabled ? "Mic on" : "Mic off";
  $("mic").setAttribute("aria-pressed", String(micTrack.enabled));
}

// Receiver-side delays (ms per frame/sample) from WebRTC stats: where delivery time goes.
window.charstreamStats = async () => {
  if (!pc) return null;
  const out = {};
  (await pc.getStats()).forEach((r) => {
    if (r.type !== "inbound-rtp") return;
    const per = (total, count) => (count ? (1000 * total) / count : null);
    out[r.kind] = {
      jitterBufferMs: per(r.jitterBufferDelay, r.jitterBufferEmittedCount),
      jitterBufferTargetMs: per(r.jitterBufferTargetDelay, r.jitterBufferEmittedCount),
      processingMs: per(r.totalProcessingDelay, r.framesDecoded),
      decodeMs: per(r.totalDecodeTime, r.framesDecoded),
      framesDropped: r.framesDropped, packetsLost: r.packetsLost,
    };
  });
  return out;
};

setInterval(() => {
  $("stats").textContent = `frames reported ${state.framesReported} · pings ${state.pings}`;
}, 500);
$("connect").onclick = connect;
$("disconnect").onclick = disconnect;
$("mic").onclick = toggleMic;
if (params.get("autoconnect")) connect();
