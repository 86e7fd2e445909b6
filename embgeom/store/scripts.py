"""Lua scripts: the conditional, atomic steps of the checkpoint protocol, one slot each.

Lua here only checks conditions and moves small values; no arithmetic on vectors runs
inside Redis. A checkpoint piece's records (up to ``EMBGEOM_PIECE_BYTES``) never pass
through Lua: :data:`GUARD_PIECE` checks, and a WATCHed ``MULTI`` of plain ``HSET`` writes
(copying megabytes into Lua strings and back cost Redis about ten times a plain HSET's
time for the same bytes, ``INFO commandstats``).

Every script names all its keys (one hash tag), so it runs unchanged on Redis Cluster.
Times are Redis's own (``TIME``), in milliseconds.
"""

from __future__ import annotations

import hashlib

import redis

__all__ = ["Script", "CLAIM_KEY", "CHECK", "NOW", "SEAL", "COMPLETE", "ADOPT", "RENEW", "GIVE_UP",
           "DEAD_LETTER", "REVIVE", "GUARD_PIECE", "PUT_SEGMENT", "FOLD", "KILL_PART", "PROGRESS",
           "REFRESH", "SLICES", "SCAN_SLICES"]

_NOW = """
local _t = redis.call('TIME')
local now = tonumber(_t[1]) * 1000 + math.floor(tonumber(_t[2]) / 1000)
"""


class Script:
    """A Lua script sent with EVALSHA, falling back to EVAL the first time a server (or
    cluster node) has not seen it; works in pipelines too (the pipeline caller handles
    NOSCRIPT by replaying with :meth:`eval_args`)."""

    def __init__(self, source: str):
        self.source = _NOW + source
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    def __call__(self, client, keys, args):
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            return client.eval(self.source, len(keys), *keys, *args)

    def queue(self, pipe, keys, args) -> None:
        """Queue on a pipeline; EVAL (not EVALSHA) so no reply can be NOSCRIPT. The script
        body is cached by the server after its first run; its text is ~2 kB per call.
        Sent as a raw command: redis-py's cluster pipeline routes EVAL by its keys but
        blocks its ``eval``/``evalsha`` helpers."""
        pipe.execute_command("EVAL", self.source, len(keys), *keys, *args)


# An Idempotency-Key's owner pair, claimed or taken over atomically.
# KEYS: eg:idem:<key>. ARGV: pair, ttl_seconds, expected (the owner a takeover replaces, or '')
# -> the owner after the call (ours when claimed, refreshed or taken over)
CLAIM_KEY = Script("""
local owner = redis.call('GET', KEYS[1])
if (not owner) or owner == ARGV[1] or (ARGV[3] ~= '' and owner == ARGV[3]) then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[2]))
  return ARGV[1]
end
return owner
""")

# Is a checkpoint still in flight, and when is it (Redis's clock, in the pair's slot)?
# KEYS: inflight. ARGV: cp -> {1 | 0, now}
CHECK = Script("""
return {redis.call('ZSCORE', KEYS[1], ARGV[1]) and 1 or 0, now}
""")

# Redis's clock on the node of KEYS[1] (TIME cannot be routed by key on a cluster).
NOW = Script("""
return now
""")

# Seal: the jobs of a window become one checkpoint, atomically, if this worker still owns
# every one of them. KEYS: gen, inflight, cp, job... ARGV: cp, gen, record, owner,
# lease_ms, epoch... -> {1, now} | {0, i} (job i is not ours) | {2, i} (job i was counted
# already, by another delivery) | {-1, 0} (collection deleted)
SEAL = Script("""
if (redis.call('GET', KEYS[1]) or '0') ~= ARGV[2] then return {-1, 0} end
for i = 4, #KEYS do
  local st = redis.call('HMGET', KEYS[i], 'status', 'epoch', 'checkpoint', 'gen')
  if st[1] == 'done' then return {2, i - 3} end
  if st[1] ~= 'running' or st[2] ~= ARGV[i + 2] or (st[4] or '0') ~= ARGV[2]
     or (st[3] and st[3] ~= '' and st[3] ~= ARGV[1]) then
    return {0, i - 3}
  end
end
redis.call('HSET', KEYS[3], 'record', ARGV[3], 'owner', ARGV[4],
           'lease_until', now + tonumber(ARGV[5]), 'sealed_at', now, 'gen', ARGV[2], 'tries', 1)
for i = 4, #KEYS do redis.call('HSET', KEYS[i], 'checkpoint', ARGV[1]) end
redis.call('ZADD', KEYS[2], now, ARGV[1])
return {1, now}
""")

# Complete: every part holds the checkpoint; its jobs are done, once. Their records then
# live ``retention`` seconds (a redelivery after that finds no record: acknowledged, not
# counted again).
# KEYS: gen, inflight, cp, meta, done, job x m, payload x m.
# ARGV: cp, done-member, retention, tokens x m
# -> {1, version} | {0, 0} (completed before) | {-1, 0} (void)
COMPLETE = Script("""
if redis.call('EXISTS', KEYS[3]) == 0 then return {0, 0} end
-- a dead-lettered checkpoint (kept, out of inflight) is not completed by a late writer
if not redis.call('ZSCORE', KEYS[2], ARGV[1]) then return {0, 0} end
local m = (#KEYS - 5) / 2
local cpgen = redis.call('HGET', KEYS[3], 'gen')
local at = string.format('%.3f', now / 1000)
local keep = tonumber(ARGV[3])
if (redis.call('GET', KEYS[1]) or '0') ~= cpgen then
  for i = 1, m do
    redis.call('HSET', KEYS[5 + i], 'status', 'failed', 'finished_at', at,
               'error', 'the collection was deleted while the job was running')
    redis.call('EXPIRE', KEYS[5 + i], keep)
    redis.call('DEL', KEYS[5 + m + i])
  end
  redis.call('DEL', KEYS[3])
  redis.call('ZREM', KEYS[2], ARGV[1])
  return {-1, 0}
end
for i = 1, m do
  redis.call('HSET', KEYS[5 + i], 'status', 'done', 'progress', '1.0', 'tokens', ARGV[3 + i],
             'finished_at', at, 'error', '')
  redis.call('EXPIRE', KEYS[5 + i], keep)
  redis.call('DEL', KEYS[5 + m + i])
end
local v = redis.call('HINCRBY', KEYS[4], 'version', 1)
redis.call('HSET', KEYS[4], 'updated_at', at)
redis.call('DEL', KEYS[3])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[5], now, ARGV[2])
return {1, v}
""")

# Adopt a sealed checkpoint whose owner went silent (or gave it up): bump the epoch of each
# of its jobs (fencing the old owner's job-level writes), take its lease, count the try.
# A try is a run without progress: ``progress`` (pieces and layer parts of it applied, or -1
# when unknown) above the last adoption's resets the count.
# KEYS: cp, job... ARGV: owner, lease_ms, max_tries (0: no limit), progress
# -> {1, epoch...} | {0} (gone, or dead-lettered) | {-1} (owner alive) | {-2, tries} (its
# tries are spent: the caller dead-letters it)
ADOPT = Script("""
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HGET', KEYS[1], 'status') == 'dead' then
  return {0}
end
local owner = redis.call('HGET', KEYS[1], 'owner')
if tonumber(redis.call('HGET', KEYS[1], 'lease_until') or '0') > now and owner ~= ARGV[1] then
  return {-1}
end
local tries = tonumber(redis.call('HGET', KEYS[1], 'tries') or '1')
local progress = tonumber(ARGV[4] or '-1')
if progress > tonumber(redis.call('HGET', KEYS[1], 'progress') or '0') then
  -- The runs since the last adoption applied pieces: they were slow or were killed, not
  -- stuck. Tries count runs without progress, so this adoption starts a new budget.
  redis.call('HSET', KEYS[1], 'progress', progress)
  tries = 1
end
if tonumber(ARGV[3] or '0') > 0 and tries >= tonumber(ARGV[3]) then return {-2, tries} end
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'lease_until', now + tonumber(ARGV[2]),
           'tries', tries + 1)
local out = {1}
for i = 2, #KEYS do
  out[#out + 1] = redis.call('HINCRBY', KEYS[i], 'epoch', 1)
  redis.call('HSET', KEYS[i], 'worker', ARGV[1], 'status', 'running')
end
return out
""")

# The owner's heartbeat keeps its checkpoint lease. KEYS: cp. ARGV: owner, lease_ms.
RENEW = Script("""
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'lease_until', now + tonumber(ARGV[2]))
return 1
""")

# The owner gives its checkpoint up (its retries are spent, or Redis refused it): the
# failure is recorded and the lease released, so the next delivery of a job adopts it.
# KEYS: cp, inflight. ARGV: owner, cp, error -> {1, tries} | {0, 0} (not ours / not in flight)
GIVE_UP = Script("""
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] or not redis.call('ZSCORE', KEYS[2], ARGV[2]) then
  return {0, 0}
end
redis.call('HINCRBY', KEYS[1], 'failures', 1)
redis.call('HSET', KEYS[1], 'error', ARGV[3], 'lease_until', 0)
return {1, tonumber(redis.call('HGET', KEYS[1], 'tries') or '1')}
""")

# Dead-letter a checkpoint in flight: it leaves ``inflight`` for ``deadletter`` (its hash
# kept, status "dead"), its jobs fail with the error (epoch bumped: every delivery of them
# is fenced), their stream entries are acknowledged. Payloads and markers are kept: a
# REVIVE resumes it. The pair's version moves: pieces it applied may have changed the data
# (read caches keyed by version must not serve what they held before).
# KEYS: inflight, cp, deadletter, stream, meta, job x m.
# ARGV: cp, error, group, entry x m -> 1 | 0 (not in flight)
DEAD_LETTER = Script("""
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
local at = string.format('%.3f', now / 1000)
redis.call('HSET', KEYS[2], 'status', 'dead', 'error', ARGV[2], 'dead_at', now, 'lease_until', 0)
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[3], now, ARGV[1])
redis.call('HINCRBY', KEYS[5], 'version', 1)
redis.call('HSET', KEYS[5], 'updated_at', at)
for i = 6, #KEYS do
  redis.call('HINCRBY', KEYS[i], 'epoch', 1)
  redis.call('HSET', KEYS[i], 'status', 'failed', 'error', ARGV[2], 'finished_at', at)
end
for i = 4, #ARGV do
  redis.call('XACK', KEYS[4], ARGV[3], ARGV[i])
  redis.call('XDEL', KEYS[4], ARGV[i])
end
return 1
""")

# Put a dead-lettered checkpoint back in flight: its jobs are queued again (new stream
# entries, recorded in the checkpoint), their next delivery adopts it and applies only the
# pieces still missing. KEYS: inflight, cp, deadletter, stream, gen, job x m. ARGV: cp, pair
# -> 1 | 0 (not dead) | -1 (its collection was deleted since)
REVIVE = Script("""
if redis.call('HGET', KEYS[2], 'status') ~= 'dead' then return 0 end
if (redis.call('GET', KEYS[5]) or '0') ~= redis.call('HGET', KEYS[2], 'gen') then return -1 end
local rec = cjson.decode(redis.call('HGET', KEYS[2], 'record'))
local entries = {}
for i = 6, #KEYS do
  entries[#entries + 1] = redis.call('XADD', KEYS[4], '*', 'job_id', rec['jobs'][i - 5],
                                     'pair', ARGV[2])
  redis.call('HSET', KEYS[i], 'status', 'queued', 'error', '', 'attempts', 0)
  redis.call('HDEL', KEYS[i], 'finished_at')
end
rec['entries'] = entries
redis.call('HSET', KEYS[2], 'record', cjson.encode(rec), 'tries', 0, 'lease_until', 0, 'error', '')
redis.call('HDEL', KEYS[2], 'status', 'dead_at')
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZADD', KEYS[1], now, ARGV[1])
return 1
""")

# Guard one piece of a checkpoint before its records are written, once. The caller holds
# the part's lock (fencing token ARGV[1]), checked at ARGV[4] that the checkpoint is in
# flight, and sends, on one connection: WATCH (every key below), this script, then
# MULTI, the piece's plain HSETs, its marker, EXEC. The bytes never pass through Lua. A
# refusal touches ``gate`` (a key watched, of the part's slot), so EXEC writes nothing;
# a success leaves every watched key as it was, so EXEC writes the piece unless another
# client modified one of them, or the lock's lease lapsed, in between (EXEC answers nil).
# KEYS: lock, applied, dead, rec, unit, scal, bkt, agg, name, gate.
# ARGV: fence, cp, piece, checked_ms, max_age_ms, unlock, marks (the part's ``applied``
#       value for cp that the caller read under its lock, '' for none)
# -> 1 write it | 2 already there | 0 lock lost (or markers moved) | -1 generation
#    deleted | -2 check too old | -3 a key holds the wrong type (EXEC would write some
#    commands and fail others: records merged without the piece's marker)
GUARD_PIECE = Script("""
local function refuse(code)
  if ARGV[6] == '1' and redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
  redis.call('SET', KEYS[10], '1', 'PX', 1000)
  return code
end
if redis.call('EXISTS', KEYS[3]) == 1 then return refuse(-1) end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return refuse(0) end
if now - tonumber(ARGV[4]) > tonumber(ARGV[5]) then return refuse(-2) end
for _, k in ipairs({2, 4, 5, 6, 7, 9}) do
  local t = redis.call('TYPE', KEYS[k])['ok']
  if t ~= 'hash' and t ~= 'none' then return refuse(-3) end
end
local t = redis.call('TYPE', KEYS[8])['ok']
if t ~= 'string' and t ~= 'none' then return refuse(-3) end
local have = redis.call('HGET', KEYS[2], ARGV[2])
if have and string.find(',' .. have .. ',', ',' .. ARGV[3] .. ',', 1, true) then
  return refuse(2)
end
if (have or '') ~= ARGV[7] then return refuse(0) end
return 1
""")


# Add a checkpoint's segment to a layer part (idempotent: one field per checkpoint).
# KEYS: seg, folded, dead. ARGV: cp, bytes, checked_ms, max_age_ms
# -> segments in the part | -1 deleted | -2 check too old | -3 already folded into base
PUT_SEGMENT = Script("""
if redis.call('EXISTS', KEYS[3]) == 1 then return -1 end
if now - tonumber(ARGV[3]) > tonumber(ARGV[4]) then return -2 end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return -3 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return redis.call('HLEN', KEYS[1])
""")

# Fold segments into the base (compaction), under the part's lock.
# KEYS: lock, seg, folded. ARGV: fence, base bytes, cp... -> 1 | 0 (lock lost)
FOLD = Script("""
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[2], 'base', ARGV[2])
for i = 3, #ARGV do
  redis.call('HDEL', KEYS[2], ARGV[i])
  redis.call('HSET', KEYS[3], ARGV[i], now)
end
redis.call('DEL', KEYS[1])
return 1
""")

# A deleted generation's part: mark it dead (later writes refused) and free it.
# KEYS: dead, key... ARGV: ttl_seconds
KILL_PART = Script("""
redis.call('SET', KEYS[1], '1', 'EX', tonumber(ARGV[1]))
for i = 2, #KEYS do redis.call('UNLINK', KEYS[i]) end
return 1
""")

# Progress is written only by the delivery that owns the job, and only while it runs:
# a stale delivery must not overwrite the owner's progress, and a heartbeat that lost the
# race with the completion must not turn a done job's progress back below 1.
PROGRESS = Script("""
if redis.call('HGET', KEYS[1], 'epoch') == ARGV[1]
    and redis.call('HGET', KEYS[1], 'status') == 'running' then
  redis.call('HSET', KEYS[1], 'progress', ARGV[2], 'tokens', ARGV[3])
  return 1
end
return 0
""")

# Keep a delivery's stream entry from being taken over (heartbeat), only while that
# delivery still owns the job: a superseded delivery must not pull the entry back.
# KEYS: job, stream. ARGV: epoch, group, consumer, entry id -> 1 | 0
REFRESH = Script("""
if redis.call('HGET', KEYS[1], 'epoch') ~= ARGV[1] then return 0 end
redis.call('XCLAIM', KEYS[2], ARGV[2], ARGV[3], 0, ARGV[4], 'JUSTID')
return 1
""")

# Reads of one layer (or a few) of records that hold every layer: each value cut, inside
# Redis, to byte ranges given by the caller and concatenated, so a read moves only the
# layers it uses (a token page of SmolLM2 reads 4.6 kB per token instead of 143 kB).
# Read-only; the caller bounds the fields per call so no call holds Redis long.
# KEYS: a hash. ARGV: r, then r pairs (start, length) of 0-based byte offsets, then fields
# -> per field its ranges concatenated, or nil when the field is absent
SLICES = Script("""
local r = tonumber(ARGV[1])
local out = {}
for i = 2 * r + 2, #ARGV do
  local v = redis.call('HGET', KEYS[1], ARGV[i])
  if v then
    local parts = {}
    for j = 1, r do
      local s = tonumber(ARGV[2 * j])
      parts[j] = string.sub(v, s + 1, s + tonumber(ARGV[2 * j + 1]))
    end
    out[#out + 1] = table.concat(parts)
  else
    out[#out + 1] = false
  end
end
return out
""")

# One HSCAN page of a hash with each value cut as in SLICES.
# KEYS: a hash. ARGV: cursor, count, r, then r pairs (start, length)
# -> {next cursor, {field, cut value, field, cut value, ...}}
SCAN_SLICES = Script("""
local page = redis.call('HSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2])
local r = tonumber(ARGV[3])
local flat = page[2]
for i = 2, #flat, 2 do
  local v = flat[i]
  local parts = {}
  for j = 1, r do
    local s = tonumber(ARGV[2 + 2 * j])
    parts[j] = string.sub(v, s + 1, s + tonumber(ARGV[3 + 2 * j]))
  end
  flat[i] = table.concat(parts)
end
return {page[1], flat}
""")
