// Follows a Durable Stream live with the official client (@durable-streams/client), over SSE, printing
// one JSON line per batch: {"offset", "items", "upToDate", "closed"}; exits 0 once the stream is closed.
//
// Resumption is the protocol's: the offset of the last batch printed is where a new session starts. The
// client (0.2.7) reconnects by itself when an SSE answer ends cleanly, but a connection cut mid-answer
// (the server killed) ends its session with an error ("terminated"): then this script waits and opens a
// new session from that offset, as an application that keeps its offset would.
//
//   node follow.mjs URL [OFFSET]          ($STREAMS_TOKEN: sent as a bearer token)
import { stream } from "@durable-streams/client"

const [url, first = "-1"] = process.argv.slice(2)
const headers = process.env.STREAMS_TOKEN ? { Authorization: `Bearer ${process.env.STREAMS_TOKEN}` } : {}
let offset = first
let closed = false
let sessions = 0
while (!closed) {
  sessions++
  try {
    const res = await stream({
      url, offset, live: "sse", json: true, headers, warnOnHttp: false,
      backoffOptions: { initialDelay: 100, maxDelay: 500, multiplier: 1.5, maxRetries: Infinity },
      onError: (error) => { process.stderr.write(`client retries after: ${error?.message ?? error}\n`); return {} },
    })
    res.subscribeJson((batch) => {
      offset = batch.offset
      closed = batch.streamClosed ?? false
      process.stdout.write(JSON.stringify({ offset, items: batch.items, upToDate: batch.upToDate, closed }) + "\n")
    })
    await res.closed
    closed = closed || res.streamClosed
  } catch (error) {
    process.stderr.write(`session ${sessions} ended (${error?.message ?? error}): resuming from ${offset}\n`)
    await new Promise((r) => setTimeout(r, 200))
  }
}
process.stdout.write(JSON.stringify({ end: true, offset, closed, sessions }) + "\n")
