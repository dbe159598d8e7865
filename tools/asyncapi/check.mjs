// Parses an AsyncAPI document with the official parser (@asyncapi/parser, pinned in
// package-lock.json) and prints every diagnostic. Exit status 0 when the document parsed
// with no error (warnings are listed, not fatal), 1 otherwise, 2 on bad usage.
//
//   node tools/asyncapi/check.mjs [docs/contract/asyncapi.json] [--json]
//
// --json prints one JSON object instead: {parsed, errors, warnings, diagnostics, channels},
// where channels maps each channel's address to its messages, each with the schema format
// and the payload schema as the parser resolved them ($refs to docs/contract/schemas/ inlined);
// tests/kafka/test_asyncapi.py validates real records against those payloads.
import { Parser, fromFile } from '@asyncapi/parser';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const args = process.argv.slice(2);
const asJson = args.includes('--json');
const files = args.filter((a) => a !== '--json');
if (files.length > 1 || files.some((f) => f.startsWith('-'))) {
  console.error('usage: node tools/asyncapi/check.mjs [ASYNCAPI_FILE] [--json]');
  process.exit(2);
}
const source = path.resolve(files[0] ?? path.join(here, '..', '..', 'docs', 'contract', 'asyncapi.json'));

// The diagnostics' severities (Spectral's DiagnosticSeverity: 0 error ... 3 hint).
const severities = ['error', 'warning', 'info', 'hint'];

const parser = new Parser();
const { document, diagnostics } = await fromFile(parser, source).parse();
const listed = diagnostics.map((d) => ({
  severity: severities[d.severity] ?? String(d.severity),
  code: String(d.code),
  path: d.path.join('/'),
  message: d.message,
}));
const errors = listed.filter((d) => d.severity === 'error').length;
const warnings = listed.filter((d) => d.severity === 'warning').length;
const parsed = document !== undefined;

function channels() {
  const out = {};
  for (const channel of document.channels()) {
    const messages = {};
    for (const message of channel.messages()) {
      // A Multi Format Schema Object ({schemaFormat, schema}) or a plain AsyncAPI schema.
      const payload = message.hasPayload() ? message.payload().json() : null;
      const multi = payload !== null && 'schemaFormat' in payload && 'schema' in payload;
      messages[message.id()] = {
        name: message.name() ?? null,
        contentType: message.contentType() ?? null,
        schemaFormat: message.schemaFormat() ?? null,
        payload: multi ? payload.schema : payload,
      };
    }
    out[channel.address()] = messages;
  }
  return out;
}

if (asJson) {
  const out = { source, parsed, errors, warnings, diagnostics: listed };
  if (parsed) out.channels = channels();
  process.stdout.write(JSON.stringify(out) + '\n');
} else {
  console.log(`${path.relative(process.cwd(), source)}: document parsed: ${parsed}, ${errors} errors, ${warnings} warnings`);
  for (const d of listed) console.log(`  ${d.severity} ${d.code} at /${d.path}: ${d.message}`);
}
// Not process.exit(): it would cut a long report short on a pipe (stdout is asynchronous there).
process.exitCode = parsed && errors === 0 ? 0 : 1;
