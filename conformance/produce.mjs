// Writes COUNT JSON messages ({"n": i}) to an existing JSON stream with the official client's
// IdempotentProducer (batched, pipelined, exactly once), then closes the stream. Prints the final offset.
//
//   node produce.mjs URL COUNT [PRODUCER_ID]
import { DurableStream, IdempotentProducer } from "@durable-streams/client"

const [url, count, producerId = "producer-1"] = process.argv.slice(2)
const handle = await DurableStream.connect({ url })
const producer = new IdempotentProducer(handle, producerId, { epoch: 0, lingerMs: 2, maxInFlight: 4 })
for (let i = 0; i < Number(count); i++) producer.append(JSON.stringify({ n: i }))
const closed = await producer.close()
process.stdout.write(JSON.stringify({ offset: closed.finalOffset }) + "\n")
