// One tool call with the official TypeScript SDK 1.x client, as a user's program makes it; prints the outcome as
// JSON. It resumes a stream that began with a priming event (GET + Last-Event-ID), with its reconnection options.
// Usage: node ts_sdk_client.mjs URL TOOL ARGUMENTS_JSON TIMEOUT_S
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const [url, tool, args, timeoutS] = process.argv.slice(2);
const client = new Client({ name: "ts-sdk-client", version: "1.0.0" });
const transport = new StreamableHTTPClientTransport(new URL(url), {
  reconnectionOptions: {
    initialReconnectionDelay: 200,
    maxReconnectionDelay: 2000,
    reconnectionDelayGrowFactor: 1.5,
    maxRetries: 10,
  },
});
let outcome;
try {
  await client.connect(transport);
  const result = await client.callTool({ name: tool, arguments: JSON.parse(args) }, undefined, {
    timeout: Number(timeoutS) * 1000,
  });
  outcome = { text: result.content[0].text, isError: Boolean(result.isError) };
} catch (error) {
  outcome = { failed: String(error).slice(0, 500) };
}
console.log(JSON.stringify(outcome));
process.exit(0);
