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
local MARKER_MAX = 64
local ID_MAX = 128    -- a unit id (enqueue checks [A-Za-z0-9._:-]{1,128})
local TOKEN_MAX = 64  -- a lease token, "<counter>-<16 hex>"
local SID_MAX = 48    -- a stream entry id, the value of a unit's s:<idx>
local FIELD_MAX = 24  -- "s:<idx>", "p:<idx>"

local function now_ms()
	local t = redis.call('TIME')
	return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function err(code, msg)
	return redis.error_reply(code .. ' ' .. msg)
end

local function type_of(key)
	return redis.call('TYPE', key).ok
end

-- Anyone with write access to the queue's keys can put anything there. A key of the queue
-- that holds another type than its own is refused by name before anything is written, so
-- no function stops halfway (an id popped from pending but never pushed anywhere else).
-- Arguments: suffix, type, suffix, type, ...
local function want(P, ...)
	local spec = {...}
	for i = 1, #spec, 2 do
		local t = type_of(P .. spec[i])
		if t ~= spec[i + 1] and t ~= 'none' then
			return err('WRONGTYPE', P .. spec[i] .. ' is a ' .. t .. ', not a ' .. spec[i + 1])
		end
	end
	return nil
end

-- history: JSON objects joined by commas on the unit hash (the dead list wraps them in
-- [ ]), newest last, cut to the last ~3 KB. Built by concatenation: this runs on every
-- claim, and decoding and re-encoding an array there would cost more than the claim.
local HIST_BYTES = 3072

local function hist_entry(now, ev, worker, attempt, why)
	local e = '{"t":' .. now .. ',"ev":"' .. ev .. '","w":"' .. (worker or '') .. '","a":' ..
		(tonumber(attempt) or 0)
	if why then e = e .. ',"why":' .. cjson.encode(why) end
	return e .. '}'
end

local function hist_append(old, entry)
	local h = (old and old ~= '') and (old .. ',' .. entry) or entry
	if #h > HIST_BYTES then
		local cut = string.find(h, ',{"t":', #h - HIST_BYTES, true)
		h = cut and string.sub(h, cut + 1) or entry -- none: not a history we wrote
	end
	return h
end

local function hist(ukey, now, ev, worker, attempt, why)
	local h = hist_append(redis.call('HGET', ukey, 'hist'), hist_entry(now, ev, worker, attempt, why))
	redis.call('HSET', ukey, 'hist', h)
end

-- wake idle workers blocked on the marker list (scripts cannot block, workers can); best
-- effort, after the write it announces: a marker key of another type only makes idle
-- workers look again a second later
local function wake(P)
	redis.pcall('RPUSH', P .. 'marker', '1')
	redis.pcall('LTRIM', P .. 'marker', -MARKER_MAX, -1)
end

-- The fencing rule: a write is accepted only from the holder of the current lease token,
-- and only while that lease has not expired by the server's clock. A worker whose lease
-- ran out is refused even before a reaper has run. f holds the unit's state, token and
-- exp fields (the lease expiry is kept on the hash as well as in the leases set, so the
-- check costs the one HMGET that also fetches what the caller needs).
local function holds(f, token, now)
	return f[1] == 'leased' and f[2] == token and (tonumber(f[3]) or 0) >= now
end

local function lease_ok(P, ukey, id, token, now)
	return holds(redis.call('HMGET', ukey, 'state', 'token', 'exp'), token, now)
end

-- the lease on id (unit key ukey) runs lease ms from now
local function extend(P, ukey, id, now, lease)
	redis.call('ZADD', P .. 'leases', now + lease, id)
	redis.call('HSET', ukey, 'exp', now + lease)
end

local function stale(id)
	return err('STALE', 'lease on ' .. id .. ' is not held by this token')
end

-- What a claim may send, from the claimer's bounds (ARGV from `from` on: max-body, the
-- longest checkpoint it can resume, max-n; an older caller sends none and nothing is
-- checked). A value over its bound never crosses the wire: its length is asked (HSTRLEN),
-- the value itself is not even read. A unit whose body (or meta, or record) is too large is
-- dead-lettered here with the reason; a checkpoint too large is left out, and its sample
-- starts over, as after any checkpoint the holder cannot read.
local function bounds_of(args, from)
	return {body = tonumber(args[from]), ckpt = tonumber(args[from + 1]),
		n = tonumber(args[from + 2])}
end

local function over(len, lim)
	return lim ~= nil and len > lim
end

-- The small fields of a unit record, or nil when ukey is no unit (missing, or a key of
-- another type that someone wrote there).
local function unit_head(ukey)
	if type_of(ukey) ~= 'hash' then return nil end
	local v = redis.call('HMGET', ukey, 'state', 'attempt', 'token', 'n', 'hist', 'npub', 'ckpt',
		'owner', 'exp')
	return {state = v[1], attempt = v[2], token = v[3], n = v[4], hist = v[5], npub = v[6],
		ckpt = v[7], owner = v[8], exp = v[9]}
end

-- The rest of f (body, meta) and its published samples and checkpoints, each checked
-- against b first. Returns pub, prog, dropped (idx, bytes of each checkpoint left out) and,
-- when the unit cannot be sent at all, why.
local function unit_body(ukey, f, b)
	local pub, prog, drop = {}, {}, {}
	local blen = redis.call('HSTRLEN', ukey, 'body')
	local mlen = redis.call('HSTRLEN', ukey, 'meta')
	if over(blen, b.body) then
		return pub, prog, drop, 'body of ' .. blen .. ' bytes is over max-body (' .. b.body ..
			' bytes)'
	end
	if over(mlen, b.body) then
		return pub, prog, drop, 'meta of ' .. mlen .. ' bytes is over max-body (' .. b.body ..
			' bytes)'
	end
	-- a fresh unit is this; only a unit with published samples or checkpoints (a resumed
	-- one) needs its field names listed
	if (tonumber(f.npub) or 0) > 0 or f.ckpt then
		local nf = redis.call('HLEN', ukey)
		local get = {}
		if b.n and nf > 2 * b.n + 64 then
			return pub, prog, drop, 'record has ' .. nf .. ' fields, more than max-n (' ..
				b.n .. ') allows'
		end
		for _, k in ipairs(redis.call('HKEYS', ukey)) do
			local c = string.sub(k, 1, 2)
			if (c == 's:' or c == 'p:') and #k <= FIELD_MAX then
				local len = redis.call('HSTRLEN', ukey, k)
				if c == 's:' and b.body and len > SID_MAX then
					return pub, prog, drop, 'field ' .. k .. ' of ' .. len ..
						' bytes is not a stream entry id'
				elseif c == 'p:' and over(len, b.ckpt) then
					drop[#drop + 1] = string.sub(k, 3)
					drop[#drop + 1] = len
				else
					get[#get + 1] = k
				end
			end
		end
		-- in slices: unpack has a limit on its arguments
		for i = 1, #get, 1000 do
			local part = {unpack(get, i, math.min(i + 999, #get))}
			local vals = redis.call('HMGET', ukey, unpack(part))
			for j, k in ipairs(part) do
				if vals[j] then
					local dst = string.sub(k, 1, 2) == 's:' and pub or prog
					dst[#dst + 1] = string.sub(k, 3)
					dst[#dst + 1] = vals[j]
				end
			end
		end
	end
	local bm = redis.call('HMGET', ukey, 'body', 'meta')
	f.body, f.meta = bm[1], bm[2]
	return pub, prog, drop, nil
end

-- the reply a claim gives for one unit: id, body, attempt, token, n, published, progress,
-- meta (copied by the holder into each of its samples), then, for a caller that sent its
-- bounds, the checkpoints left out (idx, bytes); an older caller gets the 8 it parses
local function reply_of(id, f, pub, prog, drop, b)
	local r = {id, f.body or '', tonumber(f.attempt) or 1, f.token or '0', tonumber(f.n) or 0,
		pub, prog, f.meta or ''}
	if b.ckpt then r[9] = drop end
	return r
end

-- the note a claim keeps in the history about the checkpoints it left out
local function drop_note(drop, b)
	if #drop == 0 then return nil end
	local s = {}
	for i = 1, #drop, 2 do s[#s + 1] = 'sample ' .. drop[i] .. ' (' .. drop[i + 1] .. ' bytes)' end
	return 'checkpoint of ' .. table.concat(s, ', ') .. ' over the ' .. b.ckpt ..
		'-byte bound: not sent, the sample starts over'
end

-- A unit that cannot be sent to any worker under these bounds: to dead with the reason.
-- The dead list's type was checked by the caller, so this cannot stop halfway.
local function bury(P, ukey, id, now, why, worker, attempt)
	redis.call('RPUSH', P .. 'dead', id)
	redis.call('HSET', ukey, 'state', 'dead', 'owner', '', 'reason', why, 'dead_ms', now)
	redis.call('ZREM', P .. 'leases', id)
	hist(ukey, now, 'dead', worker, attempt, why)
end

-- What a claim returns for a unit this worker already holds (a retried claim, a rescan):
-- the unit, or {id, why} when it was dead-lettered instead of sent.
local function held_reply(P, ukey, id, f, b, worker, now)
	local pub, prog, drop, why = unit_body(ukey, f, b)
	if not why and b.body and #(f.token or '') > TOKEN_MAX then
		why = 'lease token of ' .. #f.token .. ' bytes is not one of ours'
	end
	if why then
		bury(P, ukey, id, now, why, worker, f.attempt)
		return {id, why}
	end
	return reply_of(id, f, pub, prog, drop, b)
end

-- expired leases back to the head of pending (attempt + 1), or to dead past the limit
local function reap(P, now, max_attempts, limit)
	local ids = redis.call('ZRANGEBYSCORE', P .. 'leases', '-inf', now, 'LIMIT', 0, limit)
	local requeued, dead = 0, 0
	for _, id in ipairs(ids) do
		redis.call('ZREM', P .. 'leases', id)
		local ukey = P .. 'unit:' .. id
		local st = type_of(ukey) == 'hash' and redis.call('HMGET', ukey, 'state', 'attempt',
			'owner') or {}
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

-- A hash of the worker's own. One of another type (someone else wrote it) is replaced:
-- otherwise this worker could neither claim nor renew its leases.
local function own_hash(key)
	local t = type_of(key)
	if t ~= 'hash' and t ~= 'none' then redis.call('DEL', key) end
	return key
end

-- The worker's heartbeat hash: it lives while the worker does (its TTL is the heartbeat's).
local function worker_key(P, worker)
	return own_hash(P .. 'worker:' .. worker)
end

local function touch_worker(P, worker, now, ttl)
	local wkey = worker_key(P, worker)
	redis.call('HSET', wkey, 'last_seen_ms', now)
	redis.call('PEXPIRE', wkey, ttl)
	-- the directory of workers is for status only: a workers key of another type must
	-- not cost a renewal
	redis.pcall('ZADD', P .. 'workers', now, worker)
	return wkey
end

-- ARGV: (id, body, n, meta) repeated. Reply per unit: 1 queued, 0 already queued with the
-- same body, -1 the id exists with another body (nothing written for it).
local function enqueue(keys, args)
	local P = keys[1]
	local bad = want(P, 'pending', 'list')
	if bad then return bad end
	local now = now_ms()
	local out = {}
	local queued = 0
	for i = 1, #args, 4 do
		local id, body, n, meta = args[i], args[i + 1], args[i + 2], args[i + 3]
		local ukey = P .. 'unit:' .. id
		local t = type_of(ukey)
		local old = t == 'hash' and redis.call('HGET', ukey, 'body')
		if t ~= 'hash' and t ~= 'none' then
			out[#out + 1] = -1 -- the id is taken (by a key that is no unit)
		elseif old then
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

-- ARGV: worker, k, lease_ms, reqid, max_attempts, worker_ttl_ms, then the bounds
-- (max_body, max_ckpt, max_n; see bounds_of).
-- A retry with the same reqid (the reply was lost) returns the units that request took
-- instead of taking more; a claim first reaps a few expired leases so no unit waits for a
-- separate reaper. Reply: per unit, reply_of's list, or {id, reason} for a unit that was
-- dead-lettered because it cannot be sent within the bounds.
local function claim(keys, args)
	local P = keys[1]
	local worker, k, lease = args[1], tonumber(args[2]), tonumber(args[3])
	local reqid, max_attempts, wttl = args[4], tonumber(args[5]), tonumber(args[6])
	local b = bounds_of(args, 7)
	if not k or k < 1 or not lease or lease < 1 or not max_attempts or not wttl then
		return err('BADARG', 'claim: k, lease_ms, max_attempts and ttl must be positive')
	end
	local bad = want(P, 'pending', 'list', 'leases', 'zset', 'dead', 'list')
	if bad then return bad end
	local now = now_ms()
	local wkey = worker_key(P, worker)
	-- The worker's last claim: its request id and what it took, kept as long as the
	-- leases it handed out run. Not in the heartbeat hash, whose TTL (a few heartbeats)
	-- is shorter than an outage that leaves a claim unanswered: a retry after it found
	-- nothing, and the units that claim took waited out their leases, an attempt each.
	local ckey = own_hash(P .. 'claim:' .. worker)
	local out = {}
	local last = redis.call('HMGET', ckey, 'req', 'ids', 'dead')
	if last[1] == reqid then
		-- what that request took and this worker still holds, its lease made new: the
		-- worker counts its lease from this call (it may never have heard of the first,
		-- a reply lost or too late), so the server must too
		for id in string.gmatch(last[2] or '', '[^,]+') do
			local ukey = P .. 'unit:' .. id
			local f = unit_head(ukey)
			if f and f.owner == worker and f.state == 'leased' and
				(tonumber(f.exp) or 0) >= now then
				extend(P, ukey, id, now, lease)
				out[#out + 1] = held_reply(P, ukey, id, f, b, worker, now)
			end
		end
		-- (their leases run again from now: so does the memory of them)
		redis.call('PEXPIRE', ckey, lease)
		-- and what it dead-lettered instead of sending, so the worker hears of it
		for id in string.gmatch(last[3] or '', '[^,]+') do
			local f = unit_head(P .. 'unit:' .. id)
			if f and f.state == 'dead' then
				out[#out + 1] = {id, redis.call('HGET', P .. 'unit:' .. id, 'reason') or ''}
			end
		end
		return out
	end
	reap(P, now, max_attempts, 2 * k)
	local ids, dead = {}, {}
	local pops = 0
	while #ids < k and pops < 4 * k do
		local id = redis.call('LPOP', P .. 'pending')
		if not id then break end
		pops = pops + 1
		local ukey = P .. 'unit:' .. id
		-- an id no enqueue wrote, or no unit record behind it: nothing to run, dropped
		local f = #id <= ID_MAX and unit_head(ukey) or {}
		-- A unit whose lease already expired once may be what kills its workers: it is
		-- claimed alone, so a poison unit takes no batch of healthy units down with it.
		local suspect = (tonumber(f.attempt) or 1) > 1
		if f.state == 'pending' and suspect and #ids > 0 then
			redis.call('LPUSH', P .. 'pending', id)
			break
		end
		local pub, prog, drop, why
		if f.state == 'pending' then
			pub, prog, drop, why = unit_body(ukey, f, b)
		end
		if why then
			bury(P, ukey, id, now, why, worker, f.attempt)
			dead[#dead + 1] = id
			out[#out + 1] = {id, why}
		elseif f.state == 'pending' then
			-- the token is a counter and this claim's request id: a server that lost
			-- its last writes (AOF everysec) counts from an older value again, and
			-- must not hand a token it already gave out to another worker
			f.token = tostring((tonumber(string.match(f.token or '', '^%d+')) or 0) + 1) ..
				'-' .. reqid
			redis.call('HSET', ukey, 'state', 'leased', 'owner', worker, 'claimed_ms', now,
				'token', f.token, 'exp', now + lease,
				'hist', hist_append(f.hist, hist_entry(now, 'claim', worker, f.attempt,
					drop_note(drop, b))))
			redis.call('ZADD', P .. 'leases', now + lease, id)
			ids[#ids + 1] = id
			out[#out + 1] = reply_of(id, f, pub, prog, drop, b)
			if suspect then break end
		end
	end
	redis.call('HSET', ckey, 'req', reqid, 'ids', table.concat(ids, ','), 'dead',
		table.concat(dead, ','))
	redis.call('PEXPIRE', ckey, lease)
	redis.call('HSET', wkey, 'last_seen_ms', now)
	redis.call('PEXPIRE', wkey, wttl)
	return out
end

-- ARGV: worker, lease_ms, worker_ttl_ms, then (id, token) repeated. Reply: 1 renewed, 0 lost.
local function renew(keys, args)
	local P = keys[1]
	local worker, lease, wttl = args[1], tonumber(args[2]), tonumber(args[3])
	local bad = want(P, 'leases', 'zset')
	if bad then return bad end
	local now = now_ms()
	touch_worker(P, worker, now, wttl)
	local out = {}
	for i = 4, #args, 2 do
		local id, token = args[i], args[i + 1]
		local ukey = P .. 'unit:' .. id
		if lease_ok(P, ukey, id, token, now) then
			extend(P, ukey, id, now, lease)
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
			redis.call('HSET', ukey, 'p:' .. idx, data, 'ckpt', 1)
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

-- u: the unit's n, owner, attempt, token (fields 4..7 of the HMGET that checked the lease)
local function do_complete(P, ukey, id, now, n, owner, attempt, token)
	local f = {}
	for i = 0, n - 1 do f[#f + 1] = 's:' .. i end
	local sids = redis.call('HMGET', ukey, unpack(f))
	local gid = redis.call('XADD', P .. 'groups', '*', 'unit', id, 'n', n,
		'samples', table.concat(sids, ','), 'worker', owner, 'attempt', attempt)
	redis.call('HSET', ukey, 'state', 'done', 'group', gid, 'done_ms', now, 'done_token', token)
	redis.call('ZREM', P .. 'leases', id)
	redis.pcall('HINCRBY', P .. 'stats', 'done', 1) -- a count for status: best effort
	return gid
end

-- ARGV: id, token, autocomplete, then per sample: idx, nfields, field, value, ... where
-- the fields are the whole stream entry (unit, idx, worker, attempt, ..., meta) as the
-- holder of the lease writes it: the token check is what makes the holder trusted.
-- Reply: {group entry id or '', then (entry id, dup) per sample}. A second publish of a
-- sample returns its first entry id and writes nothing.
local function publish(keys, args)
	local P = keys[1]
	local id, token, auto = args[1], args[2], args[3] == '1'
	local ukey = P .. 'unit:' .. id
	local bad = want(P, 'samples', 'stream', 'groups', 'stream', 'leases', 'zset')
	if bad then return bad end
	local now = now_ms()
	local u = redis.call('HMGET', ukey, 'state', 'token', 'exp', 'n', 'owner', 'attempt', 'npub')
	if not holds(u, token, now) then return stale(id) end
	local n, npub = tonumber(u[4]), tonumber(u[7]) or 0
	local smp, look = {}, {}
	local i = 4
	while i <= #args do
		local idx, nf = tonumber(args[i]), tonumber(args[i + 1])
		if not idx or idx < 0 or idx >= n or idx ~= math.floor(idx) or not nf then
			-- the holder's body says more samples than the unit's record: the unit is
			-- inconsistent, not the call
			return err('BADUNIT', 'sample index ' .. tostring(args[i]) .. ' out of range for n=' .. n)
		end
		smp[#smp + 1] = i
		look[#look + 1] = 's:' .. idx
		look[#look + 1] = 'p:' .. idx
		i = i + 2 + 2 * nf
	end
	if #smp == 0 then return {''} end
	local have = redis.call('HMGET', ukey, unpack(look))
	local out, set, del, seen = {''}, {}, {}, {}
	for j, a in ipairs(smp) do
		local idx = args[a]
		local eid = have[2 * j - 1] or seen[idx]
		if eid then
			out[#out + 1] = eid
			out[#out + 1] = 1
		else
			eid = redis.call('XADD', P .. 'samples', '*',
				unpack(args, a + 2, a + 1 + 2 * tonumber(args[a + 1])))
			seen[idx] = eid
			set[#set + 1] = look[2 * j - 1]
			set[#set + 1] = eid
			if have[2 * j] then del[#del + 1] = look[2 * j] end
			npub = npub + 1
			out[#out + 1] = eid
			out[#out + 1] = 0
		end
	end
	if #set > 0 then redis.call('HSET', ukey, 'npub', npub, unpack(set)) end
	if #del > 0 then redis.call('HDEL', ukey, unpack(del)) end
	if auto and npub >= n then
		out[1] = do_complete(P, ukey, id, now, n, u[5], u[6], token)
	end
	return out
end

-- ARGV: id, token. Reply: the group entry id. Done again by the same token: the same id.
local function complete(keys, args)
	local P = keys[1]
	local id, token = args[1], args[2]
	local ukey = P .. 'unit:' .. id
	local u = redis.call('HMGET', ukey, 'state', 'token', 'exp', 'n', 'owner', 'attempt',
		'npub', 'done_token', 'group')
	if u[1] == 'done' and u[8] == token then return u[9] end
	local bad = want(P, 'groups', 'stream', 'leases', 'zset')
	if bad then return bad end
	local now = now_ms()
	if not holds(u, token, now) then return stale(id) end
	if (tonumber(u[7]) or 0) < tonumber(u[4]) then
		return err('INCOMPLETE', id .. ' has ' .. (u[7] or 0) .. ' of ' .. u[4] .. ' samples')
	end
	return do_complete(P, ukey, id, now, tonumber(u[4]), u[5], u[6], token)
end

local function give_back(P, ukey, id, token, head, ev, args, from)
	local bad = want(P, 'pending', 'list', 'leases', 'zset')
	if bad then return bad end
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
	local bad = want(keys[1], 'leases', 'zset', 'pending', 'list', 'dead', 'list')
	if bad then return bad end
	local r, d = reap(keys[1], now_ms(), tonumber(args[1]), tonumber(args[2]))
	return {r, d}
end

-- ARGV: id, token, reason. The holder found the unit unusable (e.g. longer than the model).
local function dead_letter(keys, args)
	local P = keys[1]
	local id, token, why = args[1], args[2], args[3]
	local ukey = P .. 'unit:' .. id
	local bad = want(P, 'dead', 'list', 'leases', 'zset')
	if bad then return bad end
	local now = now_ms()
	if not lease_ok(P, ukey, id, token, now) then return stale(id) end
	local st = redis.call('HMGET', ukey, 'owner', 'attempt')
	redis.call('HSET', ukey, 'state', 'dead', 'owner', '', 'reason', why, 'dead_ms', now)
	redis.call('ZREM', P .. 'leases', id)
	redis.call('RPUSH', P .. 'dead', id)
	hist(ukey, now, 'dead', st[1], st[2], why)
	return 1
end

-- ARGV: id, token, "<max_attempts>:<reason>", then (idx, data) repeated. The holder could
-- not run the unit: the attempt is charged (as an expired lease would be), checkpoints are
-- kept, and the unit goes to the tail of pending, or to dead past the limit. Reply: 2 dead,
-- 1 back in pending, 0 when this token's earlier call already did it.
local function fail_fn(keys, args)
	local P = keys[1]
	local id, token = args[1], args[2]
	local max_attempts, why = string.match(args[3] or '', '^(%d+):(.*)$')
	max_attempts = tonumber(max_attempts)
	if not max_attempts or max_attempts < 1 then
		return err('BADARG', 'fail: want <max_attempts>:<reason>')
	end
	local ukey = P .. 'unit:' .. id
	local bad = want(P, 'dead', 'list', 'pending', 'list', 'leases', 'zset')
	if bad then return bad end
	local now = now_ms()
	if not lease_ok(P, ukey, id, token, now) then
		local st = redis.call('HMGET', ukey, 'state', 'fail_token')
		if st[2] == token and (st[1] == 'pending' or st[1] == 'dead') then return 0 end
		return stale(id)
	end
	write_progress(ukey, args, 4)
	local st = redis.call('HMGET', ukey, 'owner', 'attempt')
	local attempt = tonumber(st[2]) or 1
	redis.call('ZREM', P .. 'leases', id)
	if attempt >= max_attempts then
		local reason = why .. ' (attempt ' .. attempt .. ' of ' .. max_attempts .. ')'
		redis.call('HSET', ukey, 'state', 'dead', 'owner', '', 'reason', reason, 'dead_ms', now,
			'fail_token', token)
		redis.call('RPUSH', P .. 'dead', id)
		hist(ukey, now, 'dead', st[1], attempt, reason)
		return 2
	end
	redis.call('HSET', ukey, 'state', 'pending', 'owner', '', 'attempt', attempt + 1,
		'last_error', why, 'fail_token', token)
	redis.call('RPUSH', P .. 'pending', id)
	hist(ukey, now, 'failed', st[1], attempt, why)
	wake(P)
	return 1
end

-- ARGV: start, count. Reply: (id, reason, attempt, history JSON) per dead unit; a record
-- of another type is listed with that as its reason.
local function dead_list(keys, args)
	local P = keys[1]
	local bad = want(P, 'dead', 'list')
	if bad then return bad end
	local ids = redis.call('LRANGE', P .. 'dead', tonumber(args[1]),
		tonumber(args[1]) + tonumber(args[2]) - 1)
	local out = {}
	for _, id in ipairs(ids) do
		local ukey = P .. 'unit:' .. id
		local t = type_of(ukey)
		if t == 'hash' or t == 'none' then
			local f = redis.call('HMGET', ukey, 'reason', 'attempt', 'hist')
			out[#out + 1] = {id, f[1] or '', f[2] or '0', '[' .. (f[3] or '') .. ']'}
		else
			out[#out + 1] = {id, ukey .. ' is a ' .. t .. ', not a hash', '0', '[]'}
		end
	end
	return out
end

-- ARGV: id. Reply: one unit as a JSON object for operators (rolloutctl unit): state, owner,
-- attempt, lease expiry, history (as stored: the entries without their brackets), and per
-- sample its stream entry id once published and its checkpoint's size and prefix. Read
-- only, and bounded whatever is stored: the body and meta are measured, never sent; a
-- checkpoint is decoded only when small, a field longer than its bound is cut.
local UNIT_INFO_SAMPLES = 1024
local UNIT_INFO_CKPT = 1048576
local function unit_info(keys, args)
	local P = keys[1]
	local id = args[1]
	local ukey = P .. 'unit:' .. id
	local t = type_of(ukey)
	if t == 'none' then return err('NOTFOUND', 'no unit ' .. id) end
	if t ~= 'hash' then return err('WRONGTYPE', ukey .. ' is a ' .. t .. ', not a hash') end
	local names = {'state', 'owner', 'attempt', 'n', 'npub', 'reason', 'claimed_ms',
		'done_ms', 'dead_ms', 'exp', 'group', 'hist'}
	local o = {id = id}
	for i, k in ipairs(names) do
		local len = redis.call('HSTRLEN', ukey, k)
		local cap = k == 'hist' and HIST_BYTES * 2 or (k == 'reason' and 4096 or 64)
		if len > cap then
			o[k] = '(' .. len .. ' bytes, not shown)'
		elseif len > 0 then
			o[k] = redis.call('HGET', ukey, k)
		end
	end
	o.body_bytes = redis.call('HSTRLEN', ukey, 'body')
	o.meta_bytes = redis.call('HSTRLEN', ukey, 'meta')
	if type_of(P .. 'leases') == 'zset' then
		o.lease_until_ms = tonumber(redis.call('ZSCORE', P .. 'leases', id))
	end
	local n = math.min(tonumber(o.n) or 0, UNIT_INFO_SAMPLES)
	local samples = {}
	for i = 0, n - 1 do
		local e = {idx = i}
		if redis.call('HSTRLEN', ukey, 's:' .. i) <= SID_MAX then
			local sid = redis.call('HGET', ukey, 's:' .. i)
			if sid then e.published = sid end
		end
		local plen = redis.call('HSTRLEN', ukey, 'p:' .. i)
		if plen > 0 then
			e.checkpoint_bytes = plen
			if plen <= UNIT_INFO_CKPT then
				local ok, c = pcall(cjson.decode, redis.call('HGET', ukey, 'p:' .. i))
				if ok and type(c) == 'table' and type(c.tokens) == 'table' then
					e.checkpoint_tokens = #c.tokens
					e.checkpoint_pos = tonumber(c.pos)
				end
			end
		end
		samples[#samples + 1] = e
	end
	o.samples = samples
	return cjson.encode(o)
end

-- ARGV: id. Back to the tail of pending with a fresh attempt count; history kept.
local function dead_retry(keys, args)
	local P = keys[1]
	local id = args[1]
	local bad = want(P, 'dead', 'list', 'pending', 'list', 'unit:' .. id, 'hash')
	if bad then return bad end
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
	local bad = want(P, 'dead', 'list')
	if bad then return bad end
	while n < limit do
		local id = redis.call('LPOP', P .. 'dead')
		if not id then break end
		redis.call('DEL', P .. 'unit:' .. id)
		n = n + 1
	end
	return n
end

-- ARGV: worker, then the bounds (as claim's). Every unit whose lease this worker holds
-- (after a reconnect the worker rescans what it holds; a claim reply may have been lost),
-- in claim's reply shape.
local function held(keys, args)
	local P = keys[1]
	local worker = args[1]
	local b = bounds_of(args, 2)
	local bad = want(P, 'leases', 'zset', 'dead', 'list')
	if bad then return bad end
	local now = now_ms()
	local ids = redis.call('ZRANGEBYSCORE', P .. 'leases', now, '+inf')
	local out = {}
	for _, id in ipairs(ids) do
		local ukey = P .. 'unit:' .. id
		local f = unit_head(ukey)
		if f and f.owner == worker then
			out[#out + 1] = held_reply(P, ukey, id, f, b, worker, now)
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
	redis.pcall('ZREMRANGEBYSCORE', P .. 'workers', '-inf', now - 86400000)
	return now
end

-- KEYS[1]: prefix. ARGV: version, uri, manifest (JSON), by. A new policy for the queue's
-- workers: refused unless its version is above the current one; idle workers woken.
local function policy_publish(keys, args)
	local P = keys[1]
	local v = tonumber(args[1])
	if not v or v < 1 or v ~= math.floor(v) then
		return err('BADARG', 'policy publish: the version must be a positive integer')
	end
	local bad = want(P, 'policy', 'hash')
	if bad then return bad end
	local cur = tonumber(redis.call('HGET', P .. 'policy', 'version') or '0') or 0
	if v <= cur then
		return err('BADARG', 'policy publish: version ' .. args[1] ..
			' is not greater than the current ' .. cur)
	end
	redis.call('HSET', P .. 'policy', 'version', args[1], 'uri', args[2], 'manifest', args[3],
		'published_ms', tostring(now_ms()), 'by', args[4])
	wake(P)
	return cur
end

redis.register_function('ro_version', function() return VERSION end)
redis.register_function('ro_policy_publish', policy_publish)
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
redis.register_function('ro_fail', fail_fn)
redis.register_function('ro_dead_list', dead_list)
redis.register_function{function_name = 'ro_unit_info', callback = unit_info,
	flags = {'no-writes'}}
redis.register_function('ro_dead_retry', dead_retry)
redis.register_function('ro_dead_purge', dead_purge)
redis.register_function('ro_held', held)
redis.register_function('ro_heartbeat', heartbeat)
