// The public conformance suite, pointed at $CONFORMANCE_TEST_URL (run.mjs sets it).
import { runConformanceTests } from "@durable-streams/server-conformance-tests"

const baseUrl = process.env.CONFORMANCE_TEST_URL
if (!baseUrl) throw new Error("set CONFORMANCE_TEST_URL (or use: node run.mjs)")
runConformanceTests({ baseUrl })
