// Throughput and write-to-read latency with the official client: STREAMS JSON streams, PRODUCERS producer
// loops (each owning STREAMS/PRODUCERS streams, one IdempotentProducer per stream, batching and pipelining
// as the client does), and a live SSE reader per stream. Each message carries its send time; a reader
// records now - sent. Closed loop: a producer appends BURST messages to each of its streams, then waits
// for their acknowledgement, and goes again, for SECONDS. With --rate N, open loop instead: N messages a
// second in all, each producer appending one at a time to its streams in turn, on a steady clock.
// With --readers-apart, the readers run in a second node process (as browsers are apart from the
// services that write): at 2,000 POSTs a second one process of the official client needs more than the
// one core node's main thread has, and its own queue would be most of what is measured. (A latency
// then spans two processes' clocks, performance.timeOrigin + now(), which agree within about a ms.)
//
//   node bench.mjs URL [--streams 64] [--producers 8] [--seconds 10] [--burst 20] [--rate 2000]
//                      [--readers-apart] [--pids 123,456]
//
// Prints one JSON line: messages/s read, latency percentiles (ms), the producers' POSTs by status, and
// the CPU seconds of this process, of the readers' (apart), and of the --pids given (the server,
// PostgreSQL), to say where the time goes.
import { fork } from "node:child_process"
import { readFileSync } from "node:fs"
import { DurableStream, IdempotentProducer, stream } from "@durable-streams/client"

const args = process.argv.slice(2)
const url = args[0]
const opt = (name, fallback) => (args.includes(`--${name}`) ? args[args.indexOf(`--${name}`) + 1] : fallback)
const STREAMS = Number(opt("streams", 64))
const PRODUCERS = Number(opt("producers", 8))
const SECONDS = Number(opt("seconds", 10))
const BURST = Number(opt("burst", 20))
const RATE = Number(opt("rate", 0))
const pids = opt("pids", "").split(",").filter(Boolean).map(Number)
const APART = args.includes("--readers-apart")
const ROLE = opt("role", "all")  // "readers": the child of --readers-apart
const run = opt("run", `${Date.now().toString(36)}`)
const ticks = 100 // USER_HZ

function cpu(pid) {  // seconds of CPU of a process and its children that have been waited for
  try {
    const fields = readFileSync(`/proc/${pid}/stat`, "utf8").split(") ")[1].split(" ")
    return (Number(fields[11]) + Number(fields[12]) + Number(fields[13]) + Number(fields[14])) / ticks
  } catch { return NaN }
}
function groupCpu(pid) {  // the process and every descendant (PostgreSQL's backends are children of it)
  let total = cpu(pid)
  try {
    const children = readFileSync(`/proc/${pid}/task/${pid}/children`, "utf8").trim().split(/\s+/).filter(Boolean)
    for (const child of children) total += groupCpu(Number(child))
  } catch { /* gone */ }
  return total
}

const latencies = []
let received = 0
let measuring = false
const streamUrl = (i) => `${url}/bench-${run}/s${i}`
async function follow() {  // a live SSE reader per stream, recording each message's write-to-read time
  const readers = await Promise.all(Array.from({ length: STREAMS }, (_, i) => stream({ url: streamUrl(i),
    offset: "-1", live: "sse", json: true, warnOnHttp: false })))
  for (const res of readers) {
    res.subscribeJson((batch) => {
      const now = performance.timeOrigin + performance.now()
      for (const item of batch.items) {
        if (!measuring) continue
        received++
        latencies.push(now - item.t)
      }
    })
  }
  return readers
}

if (ROLE === "readers") {  // the child: follow, measure between "start" and "stop", then report
  const readers = await follow()
  let cpuAtStart = null
  process.on("message", (message) => {
    if (message === "start") { measuring = true; cpuAtStart = process.cpuUsage(); return }
    measuring = false
    for (const res of readers) res.cancel()
    const used = process.cpuUsage(cpuAtStart)
    process.send({ latencies, received, cpu: (used.user + used.system) / 1e6 }, () => process.exit(0))
  })
  process.send("ready")
  await new Promise(() => {})
}

const handles = []
for (let i = 0; i < STREAMS; i++) {
  handles.push(await DurableStream.create({ url: streamUrl(i), contentType: "application/json" }))
}
let readers = []
let apart = null
function reply(child) {  // the child's next message; a child that exits first fails the run
  return new Promise((resolve, reject) => {
    const exited = (code) => reject(new Error(`the readers' process exited (code ${code}) without answering`))
    child.once("exit", exited)
    child.once("message", (message) => { child.off("exit", exited); resolve(message) })
  })
}
if (APART) {
  apart = fork(new URL(import.meta.url).pathname, [url, "--role", "readers", "--run", run, "--streams", String(STREAMS)])
  await reply(apart)  // "ready"
} else {
  readers = await follow()
}
const answers = {}  // the producers' POSTs by status (a 409 is a batch that overtook an earlier one: sent again)
const counting = async (...a) => {
  const response = await fetch(...a)
  if (measuring) answers[response.status] = (answers[response.status] ?? 0) + 1
  return response
}
const producers = handles.map((h, i) => new IdempotentProducer(h, `bench-${i}`,
  { epoch: 0, lingerMs: 1, maxInFlight: 4, fetch: counting }))
await new Promise((r) => setTimeout(r, 500))  // the readers are connected and waiting

const cpuBefore = { client: process.cpuUsage(), others: pids.map(groupCpu) }
measuring = true
apart?.send("start")
const started = performance.now()
const deadline = started + SECONDS * 1000
let sent = 0
await Promise.all(Array.from({ length: PRODUCERS }, async (_, p) => {
  const mine = producers.filter((_, i) => i % PRODUCERS === p)
  if (RATE > 0) {  // open loop: one message every `interval` ms from this producer, whatever the answers
    const interval = 1000 * PRODUCERS / RATE
    let next = performance.now()
    for (let i = 0; performance.now() < deadline; i++) {
      const wait = next - performance.now()
      if (wait > 0) await new Promise((r) => setTimeout(r, wait))
      mine[i % mine.length].append(JSON.stringify({ t: performance.timeOrigin + performance.now(), p, k: i }))
      sent++
      next += interval
    }
    await Promise.all(mine.map((producer) => producer.flush()))
    return
  }
  while (performance.now() < deadline) {
    for (const producer of mine) {
      for (let k = 0; k < BURST; k++) {
        producer.append(JSON.stringify({ t: performance.timeOrigin + performance.now(), p, k }))
        sent++
      }
    }
    await Promise.all(mine.map((producer) => producer.flush()))
  }
}))
await new Promise((r) => setTimeout(r, 1000))  // the last messages reach their readers
measuring = false
const elapsed = (performance.now() - started) / 1000 - 1
const used = process.cpuUsage(cpuBefore.client)
let readersCpu = null
if (apart) {
  const asked = reply(apart)
  apart.send("stop")
  const report = await asked
  received = report.received
  latencies.push(...report.latencies)
  readersCpu = +report.cpu.toFixed(2)
}
const others = pids.map((pid, i) => +(groupCpu(pid) - cpuBefore.others[i]).toFixed(2))
latencies.sort((a, b) => a - b)
const pct = (q) => +(latencies[Math.min(latencies.length - 1, Math.floor(q * latencies.length))] ?? NaN).toFixed(1)
console.log(JSON.stringify({
  url, streams: STREAMS, producers: PRODUCERS, rate: RATE || null, seconds: +elapsed.toFixed(1), sent, received,
  messages_per_s: Math.round(received / elapsed),
  posts: answers, latency_ms: { p50: pct(0.5), p90: pct(0.9), p99: pct(0.99), max: pct(1) },
  cpu_s: { client: +((used.user + used.system) / 1e6).toFixed(2), ...(apart ? { readers: readersCpu } : {}), ...Object.fromEntries(pids.map((pid, i) => [pid, others[i]])) },
}))
for (const res of readers) res.cancel()
await Promise.all(producers.map((p) => p.detach().catch(() => {})))
process.exit(0)
