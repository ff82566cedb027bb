#!/usr/bin/env node
// Stream a generation from a specwire target service, straight from protos/ (no generated code).
//
//   node client.js --target 127.0.0.1:50051 --prompt "def fib(n):" [--max-new-tokens 64]
//                  [--temperature T] [--seed S] [--no-speculation] [--json]
//
// SPECWIRE_TARGET stands in for --target.
//
// Prints the text as chunks arrive, then the speculation statistics. With --json it prints one
// JSON object instead: {text, token_ids, finish_reason, speculation: {...}}.
// Errors print one line on stderr and exit non-zero.
'use strict';

const path = require('path');
const { parseArgs } = require('util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', 'protos');

class UsageError extends Error {}

function loadGenerationClient(target) {
  const def = protoLoader.loadSync('specwire/v1/generation.proto', {
    includeDirs: [PROTO_ROOT],
    keepCase: true,
    longs: Number, // counters fit in a double
    enums: String,
    defaults: true,
    oneofs: true,
  });
  const { GenerationService } = grpc.loadPackageDefinition(def).specwire.v1;
  return new GenerationService(target, grpc.credentials.createInsecure());
}

function parseOptions(argv) {
  let values;
  try {
    ({ values } = parseArgs({
      args: argv,
      options: {
        target: { type: 'string' },
        prompt: { type: 'string' },
        'max-new-tokens': { type: 'string' },
        temperature: { type: 'string' },
        seed: { type: 'string' },
        'no-speculation': { type: 'boolean', default: false },
        json: { type: 'boolean', default: false },
        help: { type: 'boolean', short: 'h' },
      },
    }));
  } catch (err) {
    throw new UsageError(err.message);
  }
  if (values.help) {
    process.stdout.write(
      'usage: node client.js --target HOST:PORT --prompt TEXT [--max-new-tokens N]\n' +
        '                      [--temperature T] [--seed S] [--no-speculation] [--json]\n',
    );
    process.exit(0);
  }
  const target = values.target || process.env.SPECWIRE_TARGET;
  if (!target) throw new UsageError('--target HOST:PORT is required (or SPECWIRE_TARGET)');
  if (values.prompt === undefined) throw new UsageError('--prompt TEXT is required');
  const request = { prompt: values.prompt, sampling: {}, speculation: {} };
  if (values['max-new-tokens'] !== undefined) {
    const n = Number(values['max-new-tokens']);
    if (!Number.isInteger(n) || n < 1) throw new UsageError('--max-new-tokens must be an integer >= 1');
    request.max_new_tokens = n;
  }
  if (values.temperature !== undefined) {
    const t = Number(values.temperature);
    if (!Number.isFinite(t) || t < 0) throw new UsageError('--temperature must be a number >= 0');
    request.sampling.temperature = t;
  }
  if (values.seed !== undefined) {
    if (!/^\d+$/.test(values.seed)) throw new UsageError('--seed must be a non-negative integer');
    request.sampling.seed = values.seed; // uint64: proto-loader accepts a decimal string
  }
  if (values['no-speculation']) request.speculation.disable = true;
  return { target, json: values.json, request };
}

/** SpeculationStats message -> the plain summary both CLIs print. */
function summarize(stats) {
  const s = stats || {};
  return {
    steps: Number(s.steps || 0),
    draft_tokens: Number(s.draft_tokens || 0),
    accepted_tokens: Number(s.accepted_tokens || 0),
    acceptance_rate: Number(s.acceptance_rate || 0),
    mean_accepted_length: Number(s.mean_accepted_length || 0),
    histogram: (s.accepted_length_histogram || []).map(Number),
  };
}

function finishName(reason) {
  // "FINISH_REASON_LENGTH" -> "length"
  return String(reason || 'FINISH_REASON_UNSPECIFIED').replace(/^FINISH_REASON_/, '').toLowerCase();
}

function formatStats(spec, finishReason) {
  const hist = spec.histogram.map((n, i) => `${i}:${n}`).join(' ');
  return [
    `finish_reason: ${finishReason}`,
    `steps: ${spec.steps}  draft tokens: ${spec.draft_tokens}  accepted: ${spec.accepted_tokens}`,
    `acceptance rate: ${(100 * spec.acceptance_rate).toFixed(1)}%  ` +
      `mean accepted length: ${spec.mean_accepted_length.toFixed(2)} tokens/step`,
    `accepted-length histogram: ${hist || '(none)'}`,
  ].join('\n');
}

function generate(client, request, onChunk) {
  return new Promise((resolve, reject) => {
    const call = client.Generate(request);
    const tokenIds = [];
    const pieces = [];
    let complete = null;
    let settled = false;
    const fail = (err) => {
      if (!settled) {
        settled = true;
        reject(err);
      }
    };
    call.on('data', (msg) => {
      if (msg.chunk) {
        tokenIds.push(...msg.chunk.token_ids);
        pieces.push(msg.chunk.text);
        onChunk(msg.chunk);
      } else if (msg.complete) {
        complete = msg.complete;
      } else if (msg.error) {
        fail(new Error(`${msg.error.code}: ${msg.error.message}`));
      }
    });
    call.on('error', (err) => fail(new Error(`${grpc.status[err.code] || err.code}: ${err.details}`)));
    call.on('end', () => {
      if (settled) return;
      if (!complete) return fail(new Error('the stream ended without a completion message'));
      settled = true;
      resolve({
        text: complete.text || pieces.join(''),
        token_ids: tokenIds,
        finish_reason: finishName(complete.finish_reason),
        speculation: summarize(complete.speculation),
      });
    });
  });
}

async function main() {
  let opts;
  try {
    opts = parseOptions(process.argv.slice(2));
  } catch (err) {
    process.stderr.write(`node client: error: ${err.message}\n`);
    return 2;
  }
  const client = loadGenerationClient(opts.target);
  try {
    const onChunk = opts.json ? () => {} : (chunk) => process.stdout.write(chunk.text);
    const result = await generate(client, opts.request, onChunk);
    if (opts.json) {
      process.stdout.write(`${JSON.stringify(result)}\n`);
    } else {
      process.stdout.write(`\n\n${formatStats(result.speculation, result.finish_reason)}\n`);
    }
    return 0;
  } catch (err) {
    process.stderr.write(`node client: error: ${opts.target}: ${err.message}\n`);
    return 1;
  } finally {
    client.close();
  }
}

if (require.main === module) {
  main().then((code) => {
    process.exitCode = code;
  });
}

module.exports = { generate, summarize };
