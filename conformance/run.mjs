// Runs the public Durable Streams conformance suite (@durable-streams/server-conformance-tests) against
// `pgflow streams serve`, and against the reference server (@durable-streams/server, in memory) for
// comparison, on this machine; prints both pass counts. Exit status: 0 when pgflow passes at least
// as many tests as the reference server does.
//
//   node run.mjs [--only pgflow|reference]
//
// Environment: PGFLOW_DSN (the database; unset: pgflow's embedded server), PYTHON (default: the
// repository's .venv/bin/python, else python3). Each run uses a schema of its own, dropped afterwards.
import { spawn, spawnSync } from "node:child_process"
import { existsSync, mkdtempSync, readFileSync } from "node:fs"
import { createServer } from "node:net"
import { tmpdir } from "node:os"
import { dirname, join, resolve } from "node:path"
import { fileURLToPath } from "node:url"

const here = dirname(fileURLToPath(import.meta.url))
const root = resolve(here, "..")
const python = process.env.PYTHON ?? (existsSync(join(root, ".venv/bin/python")) ? join(root, ".venv/bin/python") : "python3")
const only = process.argv.includes("--only") ? process.argv[process.argv.indexOf("--only") + 1] : null

function freePort() {
  return new Promise((ok, fail) => {
    const server = createServer()
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address()
      server.close(() => ok(port))
    })
    server.on("error", fail)
  })
}

async function waitForPort(port, child, seconds = 60) {
  const deadline = Date.now() + seconds * 1000
  while (Date.now() < deadline) {
    if (child.exitCode !== null) throw new Error(`the server exited with ${child.exitCode}`)
    try {
      await fetch(`http://127.0.0.1:${port}/__probe__`, { method: "HEAD" })
      return
    } catch {
      await new Promise((r) => setTimeout(r, 200))
    }
  }
  throw new Error(`nothing answered on port ${port} within ${seconds} s`)
}

function suite(url) {
  const out = join(mkdtempSync(join(tmpdir(), "ds-conformance-")), "report.json")
  const run = spawnSync(join(here, "node_modules/.bin/vitest"),
    ["run", "suite.test.mjs", "--no-coverage", "--reporter=dot", "--reporter=json", `--outputFile.json=${out}`],
    { cwd: here, stdio: "inherit", env: { ...process.env, CONFORMANCE_TEST_URL: url } })
  if (!existsSync(out)) throw new Error(`vitest wrote no report (exit ${run.status})`)
  const report = JSON.parse(readFileSync(out, "utf8"))
  const failed = report.testResults.flatMap((f) => f.assertionResults.filter((t) => t.status === "failed")
    .map((t) => t.fullName))
  return { total: report.numTotalTests, passed: report.numPassedTests, failed: report.numFailedTests,
    skipped: report.numPendingTests + (report.numTodoTests ?? 0), failures: failed }
}

async function withServer(command, args, env, port, body) {
  const child = spawn(command, args, { cwd: root, env, stdio: ["ignore", "inherit", "inherit"] })
  try {
    await waitForPort(port, child)
    return await body(`http://127.0.0.1:${port}`)
  } finally {
    child.kill("SIGTERM")
    await new Promise((r) => (child.exitCode !== null ? r() : child.on("exit", r)))
  }
}

const results = {}
if (only !== "reference") {
  const port = await freePort()
  const schema = `ds_conformance_${process.pid}`
  const env = { ...process.env, PGFLOW_SCHEMA: schema }
  try {
    results.pgflow = await withServer(python, ["-m", "pgflow", "streams", "serve", "--port", String(port),
      "--cors-origin", "*", "--long-poll-timeout", "3"], env, port, suite)
  } finally {
    spawnSync(python, ["-c", `import os, psycopg
dsn = os.environ.get("PGFLOW_DSN")
if dsn:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute('DROP SCHEMA IF EXISTS "${schema}" CASCADE')`], { cwd: root, env, stdio: "inherit" })
  }
}
if (only !== "pgflow") {
  const port = await freePort()
  results.reference = await withServer("node", [join(here, "reference-server.mjs"), String(port)], process.env,
    port, suite)
}
console.log("\nDurable Streams conformance (@durable-streams/server-conformance-tests 0.3.6):")
for (const [name, r] of Object.entries(results)) {
  console.log(`  ${name.padEnd(10)} ${r.passed} passed, ${r.failed} failed, ${r.skipped} skipped of ${r.total}`)
  for (const f of r.failures) console.log(`      failed: ${f}`)
}
const { pgflow, reference } = results
const ok = !pgflow || (reference ? pgflow.passed >= reference.passed : pgflow.failed === 0)
process.exit(ok ? 0 : 1)
