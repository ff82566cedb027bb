#!/usr/bin/env node
// A custom specwire drafter in Node.js: prompt lookup (n-gram) drafting behind
// `specwire.v1.DrafterService`.
//
//   node drafter.js --port 50062 [--host 0.0.0.0] [--max-draft-len 4] [--max-ngram 3]
//   specwire target --drafter grpc://127.0.0.1:50062 ...
//
// Environment: SPECWIRE_DRAFTER_PORT, SPECWIRE_DRAFTER_HOST, SPECWIRE_MAX_DRAFT_LEN,
// SPECWIRE_MAX_NGRAM (flags win). `--port 0` picks a free port. When ready it prints one line,
// `node drafter listening on HOST:PORT`. It also serves grpc.health.v1 (SERVING once bound).
//
// Protocol (see protos/specwire/v1/drafter.proto): one session per request_id holds the committed
// tokens. Each update says how many tokens the drafter should already hold (`base_len`); a
// mismatch (e.g. this process restarted) answers `resync: true` and the target sends the full
// prefix next step. Drafts are UNPADDED (0..budget tokens) and echo the held length as base_len.
// When an update asks (max_branches), a draft also carries branches: other tokens the target
// might commit at its first positions, each with what would follow (NGramIndex.alternatives).
// The drafter works on token ids only, so it is token-agnostic: vocab_size 0, empty fingerprint.
'use strict';

const path = require('path');
const { parseArgs } = require('util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const { HealthImplementation } = require('grpc-health-check');

const PROTO_ROOT = path.resolve(__dirname, '..', '..', 'protos');
const PROTOCOL_VERSION = 1;

const KEPT = 8; // earlier occurrences remembered per n-gram (the latest one drafts)

/** The n-gram pool of one sequence: the longest earlier match of the suffix, its latest
 * occurrence, plus loops (common/ngram.py without its vote over several occurrences). */
class NGramIndex {
  constructor(maxNgram) {
    this.maxNgram = maxNgram;
    this.tokens = [];
    // "t1,t2,.." -> positions just after its latest KEPT earlier occurrences, oldest first
    this.pool = new Map();
    this.indexed = 0; // continuation starts < indexed are in the pool
  }

  /** Append committed tokens and index the n-grams they complete. */
  extend(newTokens) {
    const toks = this.tokens;
    for (const t of newTokens) toks.push(t);
    // A continuation start e needs at least one token after it: index e < toks.length.
    for (let e = Math.max(this.indexed, 1); e < toks.length; e++) {
      for (let n = 1; n <= Math.min(this.maxNgram, e); n++) {
        const key = toks.slice(e - n, e).join(',');
        const starts = this.pool.get(key) || [];
        starts.push(e);
        if (starts.length > KEPT) starts.shift();
        this.pool.set(key, starts);
      }
    }
    this.indexed = Math.max(this.indexed, toks.length);
  }

  /**
   * Branches (drafter.proto `Branch`): at each of `proposal`'s first `positions` positions,
   * up to `perPosition` tokens other than the proposal's own that followed an earlier
   * occurrence of the suffix there (longest n-gram first, latest first), each with up to
   * `horizon - position - 1` tokens after it (continued periodically over the sequence as it
   * would then be: its tokens, the proposal's first p, the branch token).
   */
  alternatives(proposal, positions, perPosition, horizon) {
    const toks = this.tokens;
    const branches = [];
    const last = Math.min(positions, proposal.length + 1, horizon);
    for (let p = 0; p < last; p++) {
      const ctx = toks.slice(-this.maxNgram).concat(proposal.slice(0, p)).slice(-this.maxNgram);
      const own = p < proposal.length ? proposal[p] : undefined;
      const found = new Map(); // token -> the start of what followed it
      for (let n = Math.min(this.maxNgram, ctx.length); n > 0 && found.size < perPosition; n--) {
        const starts = this.pool.get(ctx.slice(ctx.length - n).join(',')) || [];
        for (let i = starts.length - 1; i >= 0 && found.size < perPosition; i--) {
          const token = toks[starts[i]];
          if (token !== own && !found.has(token)) found.set(token, starts[i]);
        }
      }
      const h = horizon - p - 1;
      for (const [token, start] of found) {
        const src = toks.slice(start + 1).concat(proposal.slice(0, p), [token]);
        const tail = [];
        for (let i = 0; i < h; i++) tail.push(i < src.length ? src[i] : tail[i - src.length]);
        if (tail.length > 0) branches.push({ position: p, token, tokens: tail });
      }
    }
    return branches;
  }

  /**
   * Up to `budget` tokens continuing the longest earlier match of the suffix (unpadded).
   *
   * The latest match of a loop ("a b a b a b") sits close to the end, leaving fewer than
   * `budget` tokens after it; the sequence is then periodic with period `length - start`, so
   * the draft keeps repeating that period instead of stopping short.
   */
  propose(budget) {
    const toks = this.tokens;
    if (budget <= 0 || toks.length < 2) return [];
    for (let n = Math.min(this.maxNgram, toks.length - 1); n > 0; n--) {
      const starts = this.pool.get(toks.slice(toks.length - n).join(','));
      if (starts === undefined) continue;
      const start = starts[starts.length - 1];
      const period = toks.length - start;
      const draft = [];
      for (let i = 0; i < budget; i++) draft.push(i < period ? toks[start + i] : draft[i - period]);
      return draft;
    }
    return [];
  }
}

/** Sessions keyed by request_id; applies the target's deltas and answers one draft each. */
class PromptLookupDrafter {
  constructor({ maxDraftLen, maxNgram }) {
    this.maxDraftLen = maxDraftLen;
    this.maxNgram = maxNgram;
    this.sessions = new Map();
  }

  info() {
    return {
      protocol_version: PROTOCOL_VERSION,
      name: 'node-lookup',
      vocab_size: 0,
      tokenizer_fingerprint: '',
      max_draft_len: this.maxDraftLen,
      capabilities: ['stream', 'branches'],
    };
  }

  /** DraftRequest -> DraftResponse, and DraftStreamRequest -> DraftStreamResponse (the same
   * fields; plain objects, keepCase field names). */
  draft(request) {
    const drafts = [];
    for (const update of request.sequences || []) {
      const id = update.request_id;
      if (update.finished) {
        this.sessions.delete(id);
        continue;
      }
      const baseLen = update.base_len || 0;
      let session = this.sessions.get(id);
      if (baseLen === 0) {
        // First update or a resync: new_tokens is the full prefix.
        session = new NGramIndex(this.maxNgram);
        this.sessions.set(id, session);
      } else if (!session || session.tokens.length !== baseLen) {
        // We do not hold what the target thinks we hold: drop it and ask for the full prefix.
        this.sessions.delete(id);
        drafts.push({ request_id: id, base_len: 0, tokens: [], resync: true });
        continue;
      }
      session.extend(update.new_tokens || []);
      const budget = Math.min(update.max_draft_tokens || 0, this.maxDraftLen);
      const tokens = session.propose(budget);
      // Branches only when asked: max_branches other tokens at the first branch_positions.
      const branches =
        update.max_branches > 0 && update.branch_positions > 0 && budget > 0
          ? session.alternatives(tokens, update.branch_positions, update.max_branches, budget)
          : [];
      drafts.push({ request_id: id, base_len: session.tokens.length, tokens, resync: false, branches });
    }
    return { step: request.step, drafts };
  }
}

function loadDrafterService() {
  const def = protoLoader.loadSync('specwire/v1/drafter.proto', {
    includeDirs: [PROTO_ROOT],
    keepCase: true,
    longs: String, // uint64 step round-trips exactly
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(def).specwire.v1.DrafterService.service;
}

function intOption(value, envName, fallback, name) {
  const raw = value !== undefined ? value : process.env[envName];
  if (raw === undefined || raw === '') return fallback;
  const n = Number(raw);
  if (!Number.isInteger(n) || n < 0) {
    throw new Error(`${name} must be a non-negative integer, got ${JSON.stringify(raw)}`);
  }
  return n;
}

function parseOptions(argv) {
  const { values } = parseArgs({
    args: argv,
    options: {
      port: { type: 'string' },
      host: { type: 'string' },
      'max-draft-len': { type: 'string' },
      'max-ngram': { type: 'string' },
      help: { type: 'boolean', short: 'h' },
    },
  });
  if (values.help) {
    process.stdout.write(
      'usage: node drafter.js [--port P] [--host H] [--max-draft-len K] [--max-ngram N]\n',
    );
    process.exit(0);
  }
  const opts = {
    port: intOption(values.port, 'SPECWIRE_DRAFTER_PORT', 50052, '--port'),
    host: values.host || process.env.SPECWIRE_DRAFTER_HOST || '127.0.0.1',
    maxDraftLen: intOption(values['max-draft-len'], 'SPECWIRE_MAX_DRAFT_LEN', 4, '--max-draft-len'),
    maxNgram: intOption(values['max-ngram'], 'SPECWIRE_MAX_NGRAM', 3, '--max-ngram'),
  };
  if (opts.maxNgram < 1) throw new Error('--max-ngram must be >= 1');
  return opts;
}

function main() {
  let opts;
  try {
    opts = parseOptions(process.argv.slice(2));
  } catch (err) {
    process.stderr.write(`node drafter: error: ${err.message}\n`);
    process.exit(2);
  }
  const drafter = new PromptLookupDrafter(opts);
  const health = new HealthImplementation({ '': 'NOT_SERVING', 'specwire.v1.DrafterService': 'NOT_SERVING' });
  const server = new grpc.Server();
  health.addToServer(server);
  server.addService(loadDrafterService(), {
    GetInfo: (call, callback) => callback(null, drafter.info()),
    Draft: (call, callback) => {
      try {
        callback(null, drafter.draft(call.request));
      } catch (err) {
        callback({ code: grpc.status.INTERNAL, details: String(err && err.message) });
      }
    },
    DraftStream: (call) => {
      // One response per request, in order (handlers are synchronous, so order is kept).
      call.on('data', (request) => {
        try {
          call.write(drafter.draft(request));
        } catch (err) {
          // grpc-js turns an 'error' event into the stream's status and ends it.
          call.emit('error', { code: grpc.status.INTERNAL, details: String(err && err.message) });
        }
      });
      call.on('end', () => call.end());
      call.on('error', () => {}); // the target went away; its sessions resync on reconnect
    },
  });

  // Bracket IPv6 literals for the bind address; print the host as given.
  const bindHost = opts.host.includes(':') ? `[${opts.host}]` : opts.host;
  server.bindAsync(`${bindHost}:${opts.port}`, grpc.ServerCredentials.createInsecure(), (err, port) => {
    if (err) {
      process.stderr.write(`node drafter: error: cannot listen on ${opts.host}:${opts.port}: ${err.message}\n`);
      process.exit(1);
    }
    health.setStatus('', 'SERVING');
    health.setStatus('specwire.v1.DrafterService', 'SERVING');
    // Writes to pipes and files are synchronous in Node on Linux, so a parent waiting for this
    // line sees it at once.
    process.stdout.write(`node drafter listening on ${opts.host}:${port}\n`);
  });

  let stopping = false;
  const shutdown = (signal) => {
    if (stopping) return;
    stopping = true;
    health.setStatus('', 'NOT_SERVING');
    health.setStatus('specwire.v1.DrafterService', 'NOT_SERVING');
    const force = setTimeout(() => {
      server.forceShutdown();
      process.exit(0);
    }, 2000);
    force.unref();
    server.tryShutdown(() => process.exit(signal === 'SIGINT' ? 130 : 0));
  };
  process.on('SIGTERM', () => shutdown('SIGTERM'));
  process.on('SIGINT', () => shutdown('SIGINT'));
}

if (require.main === module) {
  main();
}

module.exports = { NGramIndex, PromptLookupDrafter };
