#!/usr/bin/env node
// Streams one completion from Baton's gRPC Generation API and prints the text as it arrives.
//
//   node generate.js "PROMPT" [--max-tokens N] [--temperature T] [--priority P] [--ignore-eos]
//
// BATON_TARGET selects the scheduler (default 127.0.0.1:50051). The .proto is loaded at run
// time with @grpc/proto-loader, so nothing is generated ahead of time.
'use strict';

const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO = path.join(__dirname, '..', '..', 'proto', 'baton', 'v1', 'generate.proto');
const USAGE = 'usage: node generate.js "PROMPT" [--max-tokens N] [--temperature T] [--priority P] [--ignore-eos]';

function parseArgs(argv) {
  const options = { prompt: null, maxTokens: 64, temperature: 0, priority: undefined, ignoreEos: false };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    const value = () => {
      if (i + 1 >= argv.length) throw new Error(`${arg} needs a value`);
      return argv[++i];
    };
    if (arg === '--max-tokens') options.maxTokens = Number.parseInt(value(), 10);
    else if (arg === '--temperature') options.temperature = Number.parseFloat(value());
    else if (arg === '--priority') options.priority = Number.parseInt(value(), 10);
    else if (arg === '--ignore-eos') options.ignoreEos = true;
    else if (arg === '-h' || arg === '--help') return null;
    else if (options.prompt === null) options.prompt = arg;
    else throw new Error(`unexpected argument ${arg}`);
  }
  if (options.prompt === null) throw new Error('a prompt is required');
  if (!(options.maxTokens >= 0) || !(options.temperature >= 0)) throw new Error('bad --max-tokens or --temperature');
  return options;
}

function loadGenerationService() {
  // keepCase: use the .proto's snake_case field names; enums as their names, so finish reasons read well.
  const definition = protoLoader.loadSync(PROTO, { keepCase: true, longs: String, enums: String, defaults: true });
  return grpc.loadPackageDefinition(definition).baton.v1.Generation;
}

function main() {
  let options;
  try {
    options = parseArgs(process.argv.slice(2));
  } catch (err) {
    console.error(`${err.message}\n${USAGE}`);
    return 2;
  }
  if (options === null) {
    console.log(USAGE);
    return 0;
  }
  const target = process.env.BATON_TARGET || '127.0.0.1:50051';
  const Generation = loadGenerationService();
  const client = new Generation(target, grpc.credentials.createInsecure());

  const request = {
    prompt: options.prompt,
    params: { max_tokens: options.maxTokens, temperature: options.temperature, ignore_eos: options.ignoreEos },
  };
  if (options.priority !== undefined) request.priority = options.priority;

  const call = client.Generate(request);
  // Ctrl-C cancels the call; Baton then cancels the request and frees its KV cache.
  process.once('SIGINT', () => call.cancel());

  let last = null;
  let failed = false;
  call.on('data', (chunk) => {
    process.stdout.write(chunk.text);
    if (chunk.finish_reason !== 'FINISH_REASON_NONE') last = chunk;
  });
  call.on('error', (err) => {
    failed = true;
    console.error(`\nbaton: ${grpc.status[err.code] || err.code}: ${err.details}`);
    process.exitCode = 1;
    client.close();
  });
  // grpc-js ends the stream after a failed call too; the error has been reported by then.
  call.on('end', () => {
    if (failed) return;
    if (last === null) {
      console.error('\nbaton: the stream ended without a finish reason');
      process.exitCode = 1;
    } else {
      const usage = last.usage || {};
      console.log(
        `\n[finish_reason=${last.finish_reason} completion_tokens=${usage.completion_tokens} ` +
          `prompt_tokens=${usage.prompt_tokens} request_id=${last.request_id}]`,
      );
    }
    client.close();
  });
  return undefined;
}

const code = main();
if (code !== undefined) process.exitCode = code;
