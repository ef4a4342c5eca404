// A reach agent in JavaScript, written from docs/protocol.md alone (no reach code in it).
//
//     NATS_URL=nats://127.0.0.1:4222 node agent.mjs AGENT_ID CAPABILITY
//
// It follows "Agent lifecycle": connect named after the agent id, subscribe to the probe,
// re-announce and task subjects, then announce (retrying with backoff) and heartbeat every
// heartbeat_interval_ms with seq 1, 2, ... and `initial` on the first beat. A task asking
// `Reach-Receipt: 1` gets the receipt body `{"request_id": ..., "status": "received"}` and
// then the result — both as bare bodies, without headers, as a reader of the protocol's
// first sentence about receipts would send them. A repeated request id gets the first
// result. SIGTERM: leave, then close.
import { randomUUID } from "node:crypto";
import { connect } from "nats";

const [agentId, capability] = process.argv.slice(2);
const prefix = "reach";
const enc = new TextEncoder();
const dec = new TextDecoder();
const json = (value) => enc.encode(JSON.stringify(value));

const nc = await connect({
  servers: (process.env.NATS_URL ?? "nats://127.0.0.1:4222").split(","),
  name: agentId,
  maxReconnectAttempts: -1,
});

let token = null;
let seq = 0;
let initial = false;
let intervalMs = 500;
let active = 0;
let okTotal = 0;
const results = new Map(); // request id -> the first result (the duplicate window)

nc.subscribe(`${prefix}.probe.${agentId}`, {
  callback: (_err, msg) => msg.respond(json({ agent_id: agentId, status: "idle", active, seq })),
});
nc.subscribe(`${prefix}.reannounce.${agentId}`, { callback: () => void announce() });
nc.subscribe(`${prefix}.task.${agentId}.${capability}`, { callback: (_err, msg) => onTask(msg) });
await nc.flush();

function onTask(msg) {
  const requestId = msg.headers?.get("Reach-Request-Id") || randomUUID();
  if (msg.headers?.get("Reach-Receipt") === "1") {
    msg.respond(json({ request_id: requestId, status: "received" }));
  }
  let result = results.get(requestId);
  if (result === undefined) {
    active += 1;
    const payload = msg.data.length ? JSON.parse(dec.decode(msg.data)) : null;
    result = { by: "javascript", agent: agentId, echo: payload };
    results.set(requestId, result);
    active -= 1;
    okTotal += 1;
  }
  msg.respond(json(result));
}

async function announce() {
  const body = json({
    agent_id: agentId,
    capabilities: [capability],
    max_concurrency: 4,
    heartbeat_interval_ms: intervalMs,
    agent_type: "javascript",
  });
  let delay = 100;
  for (;;) {
    try {
      const reply = await nc.request(`${prefix}.announce.${agentId}`, body, { timeout: 1000 });
      if (!reply.headers?.get("Nats-Service-Error-Code")) {
        const ack = JSON.parse(dec.decode(reply.data));
        token = ack.token;
        intervalMs = ack.heartbeat_interval_ms;
        seq = 0;
        initial = true;
        return;
      }
      console.error(`announce refused: ${reply.headers.get("Nats-Service-Error")}`);
    } catch (err) {
      console.error(`announce unanswered: ${err.message}`);
    }
    await new Promise((r) => setTimeout(r, delay * (0.5 + Math.random())));
    delay = Math.min(delay * 2, 5000);
  }
}

async function heartbeats() {
  for (;;) {
    if (token !== null) {
      seq += 1;
      nc.publish(
        `${prefix}.hb.${agentId}`,
        json({ agent_id: agentId, token, seq, active, ok_total: okTotal, initial }),
      );
      initial = false;
    }
    await new Promise((r) => setTimeout(r, intervalMs));
  }
}

process.on("SIGTERM", async () => {
  try {
    await nc.request(`${prefix}.leave.${agentId}`, json({ agent_id: agentId, token }), {
      timeout: 1000,
    });
  } finally {
    await nc.close();
    process.exit(0);
  }
});

await announce();
console.error(`announced ${agentId}`);
void heartbeats();
