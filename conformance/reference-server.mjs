// The reference server (@durable-streams/server, in memory) on a port, for comparison runs.
// Usage: node reference-server.mjs [port]
import { DurableStreamTestServer } from "@durable-streams/server"

const port = Number(process.argv[2] ?? 4438)
const server = new DurableStreamTestServer({ port, host: "127.0.0.1" })
await server.start()
console.log(`reference server on http://127.0.0.1:${port}`)
const stop = async () => { await server.stop(); process.exit(0) }
process.on("SIGTERM", stop)
process.on("SIGINT", stop)
