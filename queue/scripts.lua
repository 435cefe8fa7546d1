#!lua name=rolloutd
-- rolloutd work queue: every state change of a unit is one of these Redis 7 functions,
-- run atomically on the server. Loaded with FUNCTION LOAD (persisted in RDB/AOF and
-- replicated) and called with FCALL by queue/queue.c.
--
-- KEYS[1] is the queue's key prefix, "ro:{q}:". Every key a function touches is that
-- prefix plus a suffix, so all of one queue's keys share the {q} hash slot and FCALL is
-- routed by the one declared key. Lease times come from the server's TIME, never from a
-- worker's clock. Every function is safe to call again with the same arguments after a
-- lost reply: a retry either finds its own earlier effect and reports it, or is refused.

local VERSION = '@RO_SCRIPTS_VERSION@'
local HIST_MAX = 20
local MARKER_MAX = 64

local function now_ms()
	local t = redis.call('TIME')
	return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function err(code, msg)
	return redis.error_reply(code .. ' ' .. msg)
end

-- history: a short JSON array on the unit hash, newest last, for dead-letter forensics
local function hist(ukey, now, ev, worker, attempt, extra)
	local raw = redis.call('HGET', ukey, 'hist')
	local h = {}
	if raw then
		local ok, v = pcall(cjson.decode, raw)
		if ok and type(v) == 'table' then h = v end
	end
	local e = {t = now, ev = ev, w = worker or '', a = tonumber(attempt) or 0}
	if extra then e.why = extra end
	h[#h + 1] = e
	while #h > HIST_MAX do table.remove(h, 1) end
	redis.call('HSET', ukey, 'hist', cjson.encode(h))
end

-- wake idle workers blocked on the marker list (scripts cannot block, workers can)
local function wake(P)
	redis.call('RPUSH', P .. 'marker', '1')
	redis.call('LTRIM', P .. 'marker', -MARKER_MAX, -1)
end

-- The fencing rule: a write is accepted only from the holder of the current lease token,
-- and only while that lease has not expired by the server's clock. A worker whose lease
-- ran out is refused even before a reaper has run.
local function lease_ok(P, ukey, id, token, now)
	local st = redis.call('HMGET', ukey, 'state', 'token')
	if st[1] ~= 'leased' or st[2] ~= token then return false end
	local exp = redis.call('ZSCORE', P .. 'leases', id)
	if not exp or tonumber(exp) < now then return false end
	return true
end

local function stale(id)
	return err('STALE', 'lease on ' .. id .. ' is not held by this token')
end

-- the reply a claim gives for one unit: id, body, attempt, token, n, published, progress
local function unit_reply(ukey, id)
	local all = redis.call('HGETALL', ukey)
	local f = {}
	local pub, prog = {}, {}
	for i = 1, #all, 2 do
		local k, v = all[i], all[i + 1]
		local c = string.sub(k, 1, 2)
		if c == 's:' then
			pub[#pub + 1] = string.sub(k, 3)
			pub[#pub + 1] = v
		elseif c == 'p:' then
			prog[#prog + 1] = string.sub(k, 3)
			prog[#prog + 1] = v
		else
			f[k] = v
		end
	end
	return {id, f.body or '', tonumber(f.attempt) or 1, f.token or '0', tonumber(f.n) or 0, pub, prog}
end

-- expired leases back to the head of pending (attempt + 1), or to dead past the limit
local function reap(P, now, max_attempts, limit)
	local ids = redis.call('ZRANGEBYSCORE', P .. 'leases', '-inf', now, 'LIMIT', 0, limit)
	local requeued, dead = 0, 0
	for _, id in ipairs(ids) do
		redis.call('ZREM', P .. 'leases', id)
		local ukey = P .. 'unit:' .. id
		local st = redis.call('HMGET', ukey, 'state', 'attempt', 'owner')
		if st[1] == 'leased' then
			local attempt = tonumber(st[2]) or 1
			if attempt >= max_attempts then
				local why = 'lease expired on attempt ' .. attempt .. ' of ' .. max_attempts ..
					' (last owner ' .. (st[3] or '?') .. ')'
				redis.call('HSET', ukey, 'state', 'dead', 'owner', '', 'reason', why,
					'dead_ms', now)
				redis.call('RPUSH', P .. 'dead', id)
				hist(ukey, now, 'dead', st[3], attempt, why)
				dead = dead + 1
			else
				redis.call('HSET', ukey, 'state', 'pending', 'owner', '', 'attempt', attempt + 1)
				redis.call('LPUSH', P .. 'pending', id)
				hist(ukey, now, 'expired', st[3], attempt)
				requeued = requeued + 1
			end
		end
	end
	if requeued > 0 then wake(P) end
	return requeued, dead
end

local function touch_worker(P, worker, now, ttl)
	local wkey = P .. 'worker:' .. worker
	redis.call('HSET', wkey, 'last_seen_ms', now)
	redis.call('PEXPIRE', wkey, ttl)
	redis.call('ZADD', P .. 'workers', now, worker)
	return wkey
end

-- ARGV: (id, body, n, meta) repeated. Reply per unit: 1 queued, 0 already queued with the
-- same body, -1 the id exists with another body (nothing written for it).
local function enqueue(keys, args)
	local P = keys[1]
	local now = now_ms()
	local out = {}
	local queued = 0
	for i = 1, #args, 4 do
		local id, body, n, meta = args[i], args[i + 1], args[i + 2], args[i + 3]
		local ukey = P .. 'unit:' .. id
		local old = redis.call('HGET', ukey, 'body')
		if old then
			out[#out + 1] = (old == body) and 0 or -1
		else
			redis.call('HSET', ukey, 'body', body, 'n', n, 'meta', meta, 'state', 'pending',
				'attempt', 1, 'token', 0, 'npub', 0, 'enq_ms', now)
			redis.call('RPUSH', P .. 'pending', id)
			out[#out + 1] = 1
			queued = queued + 1
		end
	end
	if queued > 0 then wake(P) end
	return out
end

-- ARGV: worker, k, lease_ms, reqid, max_attempts, worker_ttl_ms.
-- A retry with the same reqid (the reply was lost) returns the units that request took
-- instead of taking more; a claim first reaps a few expired leases so no unit waits for a
-- separate reaper.
local function claim(keys, args)
	local P = keys[1]
	local worker, k, lease = args[1], tonumber(args[2]), tonumber(args[3])
	local reqid, max_attempts, wttl = args[4], tonumber(args[5]), tonumber(args[6])
	if not k or k < 1 or not lease or lease < 1 or not max_attempts then
		return err('BADARG', 'claim: k, lease_ms and max_attempts must be positive')
	end
	local now = now_ms()
	local wkey = touch_worker(P, worker, now, wttl)
	local out = {}
	local last = redis.call('HMGET', wkey, 'claim_req', 'claim_ids')
	if last[1] == reqid then
		for id in string.gmatch(last[2] or '', '[^,]+') do
			local ukey = P .. 'unit:' .. id
			if redis.call('HGET', ukey, 'owner') == worker then
				out[#out + 1] = unit_reply(ukey, id)
			end
		end
		return out
	end
	reap(P, now, max_attempts, 2 * k)
	local ids = {}
	local pops = 0
	while #ids < k and pops < 4 * k do
		local id = redis.call('LPOP', P .. 'pending')
		if not id then break end
		pops = pops + 1
		local ukey = P .. 'unit:' .. id
		local st = redis.call('HMGET', ukey, 'state', 'attempt')
		-- A unit whose lease already expired once may be what kills its workers: it is
		-- claimed alone, so a poison unit takes no batch of healthy units down with it.
		local suspect = (tonumber(st[2]) or 1) > 1
		if st[1] == 'pending' and suspect and #ids > 0 then
			redis.call('LPUSH', P .. 'pending', id)
			break
		end
		if st[1] == 'pending' then
			local token = redis.call('HINCRBY', ukey, 'token', 1)
			redis.call('HSET', ukey, 'state', 'leased', 'owner', worker, 'claimed_ms', now)
			redis.call('ZADD', P .. 'leases', now + lease, id)
			hist(ukey, now, 'claim', worker, redis.call('HGET', ukey, 'attempt'))
			ids[#ids + 1] = id
			out[#out + 1] = unit_reply(ukey, id)
			if suspect then break end
		end
	end
	redis.call('HSET', wkey, 'claim_req', reqid, 'claim_ids', table.concat(ids, ','))
	return out
end

-- ARGV: worker, lease_ms, worker_ttl_ms, then (id, token) repeated. Reply: 1 renewed, 0 lost.
local function renew(keys, args)
	local P = keys[1]
	local worker, lease, wttl = args[1], tonumber(args[2]), tonumber(args[3])
	local now = now_ms()
	touch_worker(P, worker, now, wttl)
	local out = {}
	for i = 4, #args, 2 do
		local id, token = args[i], args[i + 1]
		local ukey = P .. 'unit:' .. id
		if lease_ok(P, ukey, id, token, now) then
			redis.call('ZADD', P .. 'leases', now + lease, id)
			out[#out + 1] = 1
		else
			out[#out + 1] = 0
		end
	end
	return out
end

local function write_progress(ukey, args, from)
	local n = 0
	for i = from, #args, 2 do
		local idx, data = args[i], args[i + 1]
		if redis.call('HEXISTS', ukey, 's:' .. idx) == 0 then
			redis.call('HSET', ukey, 'p:' .. idx, data)
			n = n + 1
		end
	end
	return n
end

-- ARGV: id, token, then (idx, data) repeated. A published sample keeps no checkpoint.
local function checkpoint(keys, args)
	local P = keys[1]
	local id, token = args[1], args[2]
	local ukey = P .. 'unit:' .. id
	if not lease_ok(P, ukey, id, token, now_ms()) then return stale(id) end
	return write_progress(ukey, args, 3)
end

local function do_complete(P, ukey, id, now)
	local f = redis.call('HMGET', ukey, 'n', 'owner', 'attempt', 'token')
	local n = tonumber(f[1])
	local sids = {}
	for i = 0, n - 1 do
		sids[#sids + 1] = redis.call('HGET', ukey, 's:' .. i)
	end
	local gid = redis.call('XADD', P .. 'groups', '*', 'unit', id, 'n', n,
		'samples', table.concat(sids, ','), 'worker', f[2], 'attempt', f[3])
	redis.call('HSET', ukey, 'state', 'done', 'group', gid, 'done_ms', now, 'done_token', f[4])
	redis.call('ZREM', P .. 'leases', id)
	redis.call('HINCRBY', P .. 'stats', 'done', 1)
	return gid
end

-- ARGV: id, token, autocomplete, then per sample: idx, nfields, field, value, ...
-- Reply: {group entry id or '', then (entry id, dup) per sample}. A second publish of a
-- sample returns its first entry id and writes nothing.
local function publish(keys, args)
	local P = keys[1]
	local id, token, auto = args[1], args[2], args[3] == '1'
	local ukey = P .. 'unit:' .. id
	local now = now_ms()
	if not lease_ok(P, ukey, id, token, now) then return stale(id) end
	local u = redis.call('HMGET', ukey, 'n', 'owner', 'attempt', 'meta')
	local n = tonumber(u[1])
	local out = {''}
	local i = 4
	while i <= #args do
		local idx = tonumber(args[i])
		local nf = tonumber(args[i + 1])
		if not idx or idx < 0 or idx >= n or idx ~= math.floor(idx) or not nf then
			return err('BADARG', 'sample index ' .. tostring(args[i]) .. ' out of range for n=' .. n)
		end
		local skey = 's:' .. idx
		local have = redis.call('HGET', ukey, skey)
		if have then
			out[#out + 1] = have
			out[#out + 1] = 1
		else
			local entry = {'unit', id, 'idx', idx, 'worker', u[2], 'attempt', u[3]}
			for j = i + 2, i + 1 + 2 * nf do entry[#entry + 1] = args[j] end
			if u[4] and u[4] ~= '' then
				entry[#entry + 1] = 'meta'
				entry[#entry + 1] = u[4]
			end
			local eid = redis.call('XADD', P .. 'samples', '*', unpack(entry))
			redis.call('HSET', ukey, skey, eid)
			redis.call('HDEL', ukey, 'p:' .. idx)
			redis.call('HINCRBY', ukey, 'npub', 1)
			out[#out + 1] = eid
			out[#out + 1] = 0
		end
		i = i + 2 + 2 * nf
	end
	if auto and tonumber(redis.call('HGET', ukey, 'npub')) >= n then
		out[1] = do_complete(P, ukey, id, now)
	end
	return out
end

-- ARGV: id, token. Reply: the group entry id. Done again by the same token: the same id.
local function complete(keys, args)
	local P = keys[1]
	local id, token = args[1], args[2]
	local ukey = P .. 'unit:' .. id
	local st = redis.call('HMGET', ukey, 'state', 'done_token', 'group', 'npub', 'n')
	if st[1] == 'done' and st[2] == token then return st[3] end
	local now = now_ms()
	if not lease_ok(P, ukey, id, token, now) then return stale(id) end
	if tonumber(st[4]) < tonumber(st[5]) then
		return err('INCOMPLETE', id .. ' has ' .. st[4] .. ' of ' .. st[5] .. ' samples')
	end
	return do_complete(P, ukey, id, now)
end

local function give_back(P, ukey, id, token, head, ev, args, from)
	local now = now_ms()
	if not lease_ok(P, ukey, id, token, now) then
		local st = redis.call('HMGET', ukey, 'state', 'token')
		if st[1] == 'pending' and st[2] == token then return 0 end -- our own earlier call
		return stale(id)
	end
	write_progress(ukey, args, from)
	local owner = redis.call('HGET', ukey, 'owner')
	redis.call('HSET', ukey, 'state', 'pending', 'owner', '')
	redis.call('ZREM', P .. 'leases', id)
	if head then
		redis.call('LPUSH', P .. 'pending', id)
	else
		redis.call('RPUSH', P .. 'pending', id)
	end
	hist(ukey, now, ev, owner, redis.call('HGET', ukey, 'attempt'))
	wake(P)
	return 1
end

-- ARGV: id, token, then (idx, data) repeated: the drain path. Checkpoints and the move to
-- the head of pending happen in one step; the attempt count is not charged.
local function requeue(keys, args)
	local P = keys[1]
	return give_back(P, P .. 'unit:' .. args[1], args[1], args[2], true, 'requeue', args, 3)
end

-- ARGV: id, token. Back to the tail of pending, progress kept (e.g. policy too old here).
local function release(keys, args)
	local P = keys[1]
	return give_back(P, P .. 'unit:' .. args[1], args[1], args[2], false, 'release', args, 3)
end

-- ARGV: max_attempts, limit. Reply: {requeued, dead}.
local function reap_fn(keys, args)
	local r, d = reap(keys[1], now_ms(), tonumber(args[1]), tonumber(args[2]))
	return {r, d}
end

-- ARGV: id, token, reason. The holder found the unit unusable (e.g. longer than the model).
local function dead_letter(keys, args)
	local P = keys[1]
	local id, token, why = args[1], args[2], args[3]
	local ukey = P .. 'unit:' .. id
	local now = now_ms()
	if not lease_ok(P, ukey, id, token, now) then return stale(id) end
	local st = redis.call('HMGET', ukey, 'owner', 'attempt')
	redis.call('HSET', ukey, 'state', 'dead', 'owner', '', 'reason', why, 'dead_ms', now)
	redis.call('ZREM', P .. 'leases', id)
	redis.call('RPUSH', P .. 'dead', id)
	hist(ukey, now, 'dead', st[1], st[2], why)
	return 1
end

-- ARGV: start, count. Reply: (id, reason, attempt, history JSON) per dead unit.
local function dead_list(keys, args)
	local P = keys[1]
	local ids = redis.call('LRANGE', P .. 'dead', tonumber(args[1]),
		tonumber(args[1]) + tonumber(args[2]) - 1)
	local out = {}
	for _, id in ipairs(ids) do
		local f = redis.call('HMGET', P .. 'unit:' .. id, 'reason', 'attempt', 'hist')
		out[#out + 1] = {id, f[1] or '', f[2] or '0', f[3] or '[]'}
	end
	return out
end

-- ARGV: id. Back to the tail of pending with a fresh attempt count; history kept.
local function dead_retry(keys, args)
	local P = keys[1]
	local id = args[1]
	if redis.call('LREM', P .. 'dead', 1, id) == 0 then
		return err('NOTFOUND', id .. ' is not in the dead-letter list')
	end
	local ukey = P .. 'unit:' .. id
	local now = now_ms()
	redis.call('HSET', ukey, 'state', 'pending', 'attempt', 1, 'reason', '')
	redis.call('RPUSH', P .. 'pending', id)
	hist(ukey, now, 'retry', '', 1)
	wake(P)
	return 1
end

-- ARGV: limit. Deletes up to limit dead units; reply: how many. Call until 0.
local function dead_purge(keys, args)
	local P = keys[1]
	local limit = tonumber(args[1])
	local n = 0
	while n < limit do
		local id = redis.call('LPOP', P .. 'dead')
		if not id then break end
		redis.call('DEL', P .. 'unit:' .. id)
		n = n + 1
	end
	return n
end

-- ARGV: worker. Every unit whose lease this worker holds (after a reconnect the worker
-- rescans what it holds; a claim reply may have been lost).
local function held(keys, args)
	local P = keys[1]
	local worker = args[1]
	local now = now_ms()
	local ids = redis.call('ZRANGEBYSCORE', P .. 'leases', now, '+inf')
	local out = {}
	for _, id in ipairs(ids) do
		local ukey = P .. 'unit:' .. id
		if redis.call('HGET', ukey, 'owner') == worker then
			out[#out + 1] = unit_reply(ukey, id)
		end
	end
	return out
end

-- ARGV: worker, ttl_ms, then (field, value) repeated.
local function heartbeat(keys, args)
	local P = keys[1]
	local now = now_ms()
	local wkey = touch_worker(P, args[1], now, tonumber(args[2]))
	for i = 3, #args, 2 do redis.call('HSET', wkey, args[i], args[i + 1]) end
	-- forget workers silent for a day; their hashes expired long ago
	redis.call('ZREMRANGEBYSCORE', P .. 'workers', '-inf', now - 86400000)
	return now
end

redis.register_function('ro_version', function() return VERSION end)
redis.register_function('ro_enqueue', enqueue)
redis.register_function('ro_claim', claim)
redis.register_function('ro_renew', renew)
redis.register_function('ro_checkpoint', checkpoint)
redis.register_function('ro_publish', publish)
redis.register_function('ro_complete', complete)
redis.register_function('ro_requeue', requeue)
redis.register_function('ro_release', release)
redis.register_function('ro_reap', reap_fn)
redis.register_function('ro_dead_letter', dead_letter)
redis.register_function('ro_dead_list', dead_list)
redis.register_function('ro_dead_retry', dead_retry)
redis.register_function('ro_dead_purge', dead_purge)
redis.register_function('ro_held', held)
redis.register_function('ro_heartbeat', heartbeat)
