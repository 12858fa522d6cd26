"""Context parallelism: attention over a sequence whose KV cache (decode) or whose tokens (prefill) are split by
position across ranks (docs/context_parallel.md).

sparsa has no transport of its own. Every function here takes a `group` with three collectives:

    group.rank, group.size
    group.all_reduce_max(x) / group.all_reduce_sum(x)   element-wise, in place, returns x
    group.all_gather(x)                                 a new array [size, *x.shape], in rank order

TorchGroup provides them through torch.distributed (NCCL for CUDA tensors, gloo for CPU tensors) on the caller's
process group; ThreadGroup simulates `size` ranks as threads of one process (numpy arrays), for tests and for
trying the protocol without torch.

Decode (cp_decode): rank r holds keys [kv_start[b], kv_start[b] + L_b) of each sequence b of full length
kv_total[b], computes its partial (out, lse) under the policy, and the partial states are merged exactly
(sparsa_merge_states). TOKEN_SELECT's selection is global (sparsa_cp_select_*) and equal to the single-device
selection. Prefill (prefill): the tokens are split zig-zag (zigzag_ranges) so that causal work is balanced; the
keys are all-gathered and each rank attends with its own query rows over the causal key prefix, which is exact for
every policy whose decisions are local to a query row or a query block (DENSE, SINK_WINDOW, BLOCK_SPARSE, and Δ on
top of them, composed here from its dense anchor rows).
"""
import copy
import threading

import numpy

from . import _library as L
from . import ops
from .policy import BlockSparse, Dense, SinkWindow, Sparge, TokenIndices, TokenSelect


# ---- Groups ------------------------------------------------------------------------------------------------------

class TorchGroup:
    """The three collectives over torch.distributed, on `group` (None = the default process group). With the NCCL
    backend, host tensors travel through the current CUDA device and come back to the host."""

    def __init__(self, group=None):
        import torch
        import torch.distributed as dist
        self._dist = dist
        self._group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        nccl = dist.get_backend(group) == "nccl"
        self._device = torch.device("cuda", torch.cuda.current_device()) if nccl else None

    def _on_device(self, x):
        return x.to(self._device) if self._device is not None and x.device != self._device else x

    def _reduce(self, x, op):
        y = self._on_device(x.contiguous())
        self._dist.all_reduce(y, op=op, group=self._group)
        if y.data_ptr() != x.data_ptr():
            x.copy_(y)
        return x

    def all_reduce_max(self, x):
        return self._reduce(x, self._dist.ReduceOp.MAX)

    def all_reduce_sum(self, x):
        return self._reduce(x, self._dist.ReduceOp.SUM)

    def all_gather(self, x):
        import torch
        y = self._on_device(x.contiguous())
        if self._device is None:  # gloo (older releases have no all_gather_into_tensor for it)
            parts = [torch.empty_like(y) for _ in range(self.size)]
            self._dist.all_gather(parts, y, group=self._group)
            return torch.stack(parts)
        gathered = torch.empty((self.size, *y.shape), dtype=y.dtype, device=y.device)
        self._dist.all_gather_into_tensor(gathered, y, group=self._group)  # one NCCL call into one buffer
        return gathered.to(x.device)

    def all_to_all(self, parts, receive_counts):
        """parts[r] [n_r, ...] goes to rank r; returns what each rank sent here, [receive_counts[r], ...] each."""
        import torch
        row_shape = parts[0].shape[1:]
        row_elements = int(numpy.prod(row_shape, dtype=numpy.int64))
        send = self._on_device(torch.cat([p.reshape(p.shape[0], row_elements) for p in parts]).contiguous())
        received = torch.empty((sum(receive_counts), send.shape[1]), dtype=send.dtype, device=send.device)
        self._dist.all_to_all_single(received, send, output_split_sizes=list(receive_counts),
                                     input_split_sizes=[int(p.shape[0]) for p in parts], group=self._group)
        received = received.to(parts[0].device)
        out, at = [], 0
        for count in receive_counts:
            out.append(received[at:at + count].reshape(count, *row_shape))
            at += count
        return out


class ThreadGroup:
    """`size` simulated ranks in one process: run each rank's code on its own thread with `member(rank)` as its
    group (numpy arrays). Every rank must call the same collectives in the same order, as with a real group."""

    def __init__(self, size):
        self.size = size
        self._barrier = threading.Barrier(size)
        self._slots = [None] * size

    def member(self, rank):
        return _ThreadMember(self, rank)

    def run(self, function):
        """Runs function(rank, member) on `size` threads and returns the results in rank order; re-raises the first
        exception (the other ranks are released from their barrier with BrokenBarrierError)."""
        results, failures = [None] * self.size, []

        def body(rank):
            try:
                results[rank] = function(rank, self.member(rank))
            except BaseException as exc:  # noqa: B902 - every failure is reported to the caller
                failures.append(exc)
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(rank,)) for rank in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]
        return results


class _ThreadMember:
    def __init__(self, shared, rank):
        self._shared = shared
        self.rank = rank
        self.size = shared.size

    def _exchange(self, x):
        return self._exchange_objects(numpy.array(x, copy=True))

    def all_reduce_max(self, x):
        x[...] = numpy.maximum.reduce(self._exchange(x))
        return x

    def all_reduce_sum(self, x):
        x[...] = numpy.sum(self._exchange(x), axis=0, dtype=x.dtype)
        return x

    def all_gather(self, x):
        return numpy.stack(self._exchange(x))

    def all_to_all(self, parts, receive_counts):
        received = [sent[self.rank] for sent in self._exchange_objects([numpy.array(p, copy=True) for p in parts])]
        assert [len(r) for r in received] == list(receive_counts), "all_to_all: counts differ from what was sent"
        return received

    def _exchange_objects(self, value):
        """Every rank's `value`, in rank order."""
        shared = self._shared
        shared._slots[self.rank] = value
        shared._barrier.wait()
        parts = list(shared._slots)
        shared._barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return parts


# ---- Internals -----------------------------------------------------------------------------------------------------

def _like(template, array):
    """`array` (numpy array or torch tensor) as the same kind and device as `template` (numpy array or torch
    tensor), contiguous."""
    if type(array).__module__.split(".")[0] == "torch":
        if hasattr(template, "device"):
            return array.to(template.device).contiguous()
        return numpy.ascontiguousarray(array.cpu().numpy())
    if type(template).__module__.split(".")[0] == "torch":
        import torch
        return torch.from_numpy(numpy.ascontiguousarray(array)).to(template.device)
    return numpy.ascontiguousarray(array)


def _host_int32(x, name):
    array = numpy.asarray(x.cpu() if hasattr(x, "cpu") else x, dtype=numpy.int32)
    if array.ndim != 1:
        raise ValueError(f"{name}: expected int32 [B], got shape {array.shape}")
    return numpy.ascontiguousarray(array)


def _shard_lengths(k, seq_lens_k, batch):
    if seq_lens_k is not None:
        return _host_int32(seq_lens_k, "seq_lens_k")
    return numpy.full(batch, k.shape[1], dtype=numpy.int32)


def _local_index_lists(rows, kv_start, lengths):
    """int32 [B, H_idx, width] from rows[b][r] = global positions (int64 numpy, ascending, unique): those on this
    shard, as local ids, -1-padded; width = the longest such row (at least 1), so the run walks no empty slots."""
    local = []
    for b, sequence_rows in enumerate(rows):
        low, high = int(kv_start[b]), int(kv_start[b]) + int(lengths[b])
        local.append([row[(row >= low) & (row < high)] - low for row in sequence_rows])
    width = max([1] + [len(row) for sequence_rows in local for row in sequence_rows])
    out = numpy.full((len(local), len(local[0]), width), -1, dtype=numpy.int32)
    for b, sequence_rows in enumerate(local):
        for r, row in enumerate(sequence_rows):
            out[b, r, :len(row)] = row
    return out


# ---- Decode ------------------------------------------------------------------------------------------------------

def token_select_indices(ctx, group, q, k, v, policy, kv_start, kv_total, *, seq_lens_k=None, softmax_scale=0.0):
    """This rank's part of TOKEN_SELECT's index set (sparsa_cp_select_*, three collectives in between): int32
    [B, n_sets, cap] local key ids, equal on every rank to its slice of the single-device selection."""
    kv_start, kv_total = _host_int32(kv_start, "kv_start"), _host_int32(kv_total, "kv_total")
    common = dict(seq_lens_k=seq_lens_k, softmax_scale=softmax_scale)
    global_max = group.all_reduce_max(ops.cp_select_max(ctx, q, k, v, policy, kv_start, kv_total, **common))
    global_sum = group.all_reduce_sum(
        ops.cp_select_sum(ctx, q, k, v, policy, kv_start, kv_total, global_max, **common))
    votes, positions = ops.cp_select_topk(ctx, q, k, v, policy, kv_start, kv_total, global_max, global_sum,
                                          **common)
    all_votes, all_positions = group.all_gather(votes), group.all_gather(positions)
    return ops.cp_select_indices(ctx, q, k, v, policy, kv_start, kv_total, all_votes, all_positions, **common)


def _same_for_every_sequence(kv_start, kv_total, lengths):
    return len(kv_start) > 0 and all(len(set(x.tolist())) == 1 for x in (kv_start, kv_total, lengths))


def _visible_head_and_tail(start, length, total, head, tail):
    """For a shard holding global positions [start, start + length) of a sequence of `total` keys: how many of its
    first keys lie in the global head [0, head) and how many of its last keys in the global tail
    [total - tail, total). Both pieces start (head) or end (tail) at the shard's own ends, so a run on the shard
    expresses them as its own n_init / n_local."""
    local_head = max(0, min(head - start, length))
    local_tail = max(0, min(start + length - (total - tail), length))
    return local_head, local_tail


def _first_row_positions(rows, kv_start, kv_total):
    """Local position of each sequence's first query row on this shard (arrays or scalars): the rows are the
    sequence's last `rows` positions, kv_total - rows .. kv_total - 1."""
    return numpy.asarray(kv_total, numpy.int64) - rows - numpy.asarray(kv_start, numpy.int64)


def _run_offsets(rows, kv_start, kv_total, lengths):
    """§0's o of the shard's run per sequence (arrays or scalars): the first query row's local position, clamped
    to [-rows, L] (rows past the shard's end see all of its keys causally; SINK_WINDOW's window is shortened by the
    rest). One row needs no query_offsets: bottom-right alignment puts it at L - 1, after every key of the shard."""
    lengths = numpy.asarray(lengths, numpy.int64)
    if rows == 1:
        return lengths - 1
    return numpy.clip(_first_row_positions(rows, kv_start, kv_total), -rows, lengths)


def _shard_policy_same_cut(q, policy, start, length, total):
    """The shard's own policy when every sequence has the same cut (no index lists on the host), or None. The run
    places the query rows at _run_offsets."""
    if isinstance(policy, SinkWindow):
        rows = q.shape[1]
        beyond = int(_first_row_positions(rows, start, total) - _run_offsets(rows, start, total, length))  # past o
        return SinkWindow(max(0, min(policy.sink_tokens - start, length)), max(0, policy.window - beyond))
    if isinstance(policy, TokenIndices) and policy.block_size == 1:
        n_init, n_local = _visible_head_and_tail(start, length, total, policy.n_init, policy.n_local)
        indices = policy.indices
        if type(indices).__module__.split(".")[0] == "torch":
            import torch
            inside = (indices >= start) & (indices < start + length)
            local = torch.where(inside, indices - start, torch.full_like(indices, -1)).to(torch.int32)
        else:
            indices = numpy.asarray(indices)
            inside = (indices >= start) & (indices < start + length)
            local = numpy.where(inside, indices - start, -1).astype(numpy.int32)
        return TokenIndices(_like(q, local), head_map=policy.head_map, n_init=n_init, n_local=n_local)
    return None


def _shard_policy(ctx, group, q, k, v, policy, kv_start, kv_total, seq_lens_k, softmax_scale):
    """The policy that makes this rank attend to its part of the policy's key set (decode: the query row is the
    last position, kv_total[b] - 1): the policy itself for DENSE; SINK_WINDOW and TOKEN_INDICES with their sink /
    window / n_init / n_local cut to the shard and indices made local when every sequence has the same cut; else a
    TOKEN_INDICES policy with host-built lists."""
    kv_start, kv_total = _host_int32(kv_start, "kv_start"), _host_int32(kv_total, "kv_total")
    lengths = _shard_lengths(k, seq_lens_k, len(kv_start))
    batch = len(kv_start)
    if getattr(policy, "delta", None) is not None:
        if _delta_split(q.shape[1], policy.delta) > 0:  # §8: with s_p <= 0 every row is dense (a decode row)
            raise NotImplementedError("cp_decode: Δ with this many query rows (the sparse part of §8) is not "
                                      "supported; decode rows are dense under Δ")
        policy = Dense()
    if isinstance(policy, Dense):
        return policy  # a decode row sees every key of its shard
    if _same_for_every_sequence(kv_start, kv_total, lengths):
        same_cut = _shard_policy_same_cut(q, policy, int(kv_start[0]), int(lengths[0]), int(kv_total[0]))
        if same_cut is not None:
            return same_cut
    if isinstance(policy, TokenSelect):
        return TokenIndices(token_select_indices(ctx, group, q, k, v, policy, kv_start, kv_total,
                                                 seq_lens_k=seq_lens_k, softmax_scale=softmax_scale))
    if isinstance(policy, SinkWindow):
        if q.shape[1] > 1:  # one host-built list per head cannot hold a window that moves with the row
            raise NotImplementedError("cp_decode: SINK_WINDOW over shards cut differently per sequence needs one "
                                      "query row")
        rows = []
        for b in range(batch):
            n = int(kv_total[b])
            rows.append([numpy.concatenate([numpy.arange(min(policy.sink_tokens, n)),
                                            numpy.arange(max(policy.sink_tokens, n - policy.window), n)])])
        return TokenIndices(_like(q, _local_index_lists(rows, kv_start, lengths)))
    if isinstance(policy, TokenIndices) and policy.block_size == 1:
        indices = numpy.asarray(policy.indices.cpu() if hasattr(policy.indices, "cpu") else policy.indices)
        rows = []
        for b in range(batch):
            n = int(kv_total[b])
            always = numpy.concatenate([numpy.arange(min(policy.n_init, n)),
                                        numpy.arange(max(0, n - policy.n_local), n)])
            rows.append([numpy.union1d(always, row[row >= 0].astype(numpy.int64)) for row in indices[b]])
        return TokenIndices(_like(q, _local_index_lists(rows, kv_start, lengths)), head_map=policy.head_map)
    raise NotImplementedError(f"cp_decode: {type(policy).__name__} is not supported (DENSE, SINK_WINDOW, "
                              "TOKEN_INDICES with block_size 1 and TOKEN_SELECT are)")


def merge_gathered(ctx, outs, lses):
    """Merges [G, ...] partial states in rank order with sparsa_merge_states; returns (out, lse)."""
    out, lse = outs[0], lses[0]
    for g in range(1, len(outs)):
        out, lse = ops.merge_states(ctx, out, lse, outs[g], lses[g])
    return out, lse


def cp_decode(ctx, group, q, k, v, policy=None, *, kv_start, kv_total, seq_lens_k=None, softmax_scale=0.0):
    """Decode attention over a KV cache split by position across the group's ranks. q [B, Sq, Hq, D] (every rank
    the same): the sequences' last Sq positions (one decode row, or a speculative / chunked step of a few, causal
    among them); k/v [B, L, Hkv, D] this rank's keys (seq_lens_k for ragged shards); kv_start / kv_total int32 [B].
    With several rows each rank's run places them with query_offsets. Returns (out, lse) of the whole cache, the
    same on every rank (partial states all-gathered and merged)."""
    policy = policy if policy is not None else Dense()
    shard_policy = _shard_policy(ctx, group, q, k, v, policy, kv_start, kv_total, seq_lens_k, softmax_scale)
    offsets = None
    if q.shape[1] > 1:
        host_start, host_total = _host_int32(kv_start, "kv_start"), _host_int32(kv_total, "kv_total")
        lengths = _shard_lengths(k, seq_lens_k, len(host_start))
        offsets = _like(q, _run_offsets(q.shape[1], host_start, host_total, lengths).astype(numpy.int32))
    out, lse, _, _, _ = ops.attention(ctx, q, k, v, policy=shard_policy, causal=True, lse=True,
                                      seq_lens_k=seq_lens_k, softmax_scale=softmax_scale, query_offsets=offsets)
    return merge_gathered(ctx, group.all_gather(out), group.all_gather(lse))


# ---- Prefill -----------------------------------------------------------------------------------------------------

def zigzag_ranges(total, size, rank):
    """The two token ranges rank `rank` of `size` holds: chunks rank and 2·size − 1 − rank of 2·size equal chunks
    (total must be a multiple of 2·size), so that every rank has the same amount of causal work."""
    if total % (2 * size) != 0:
        raise ValueError(f"zigzag_ranges: total {total} is not a multiple of 2 * size = {2 * size}")
    chunk = total // (2 * size)
    return [(rank * chunk, (rank + 1) * chunk), ((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)]


def _concat(parts, axis):
    if type(parts[0]).__module__.split(".")[0] == "torch":
        import torch
        return torch.cat(list(parts), dim=axis)
    return numpy.concatenate(list(parts), axis=axis)


def _block_aligned(policy, start, chunk):
    if start % policy.block_q != 0 or chunk % policy.block_q != 0:
        raise ValueError(f"prefill: chunks of {chunk} tokens must be multiples of block_q {policy.block_q}")


def _chunk_policy(policy, start, end, chunk):
    """The policy for query rows [start, end) over keys [0, end): BLOCK_SPARSE's mask cut to those blocks."""
    if isinstance(policy, BlockSparse):
        _block_aligned(policy, start, chunk)
        mask = policy.mask[:, :, start // policy.block_q:-(-end // policy.block_q), :-(-end // policy.block_k)]
        return BlockSparse(_contiguous(mask), block_q=policy.block_q, block_k=policy.block_k)
    return policy


def _delta_split(rows, delta):
    """§8's s_p for a query of `rows` rows: rows from s_p on are dense (s_p <= 0: all of them)."""
    return rows - (rows % delta.gamma + max(delta.tail_min, delta.gamma))


def _delta_chunk(ctx, q_chunk, k, v, base, delta, start, end, total, softmax_scale):
    """§8 for query rows [start, end) of a prompt of `total` rows: rows >= s_p dense; rows i < s_p get
    O_sparse[i] + (O_dense[r] - O_sparse[r]) with r = floor(i / gamma) * gamma, which lies in the chunk because
    chunks are multiples of gamma."""
    gamma = delta.gamma
    if start % gamma != 0 or (end - start) % gamma != 0:
        raise ValueError(f"prefill: Δ needs chunks that are multiples of gamma {gamma}")
    split = _delta_split(total, delta)
    out = ops.attention(ctx, q_chunk, k[:, :end], v[:, :end], policy=base, causal=True, softmax_scale=softmax_scale)
    dense_from = max(start, split)
    if dense_from < end:  # the dense tail
        out[:, dense_from - start:] = ops.attention(ctx, _contiguous(q_chunk[:, dense_from - start:]), k[:, :end],
                                                    v[:, :end], causal=True, softmax_scale=softmax_scale)
    for anchor in range(start, min(end, split), gamma):
        row = anchor - start
        dense = ops.attention(ctx, _contiguous(q_chunk[:, row:row + 1]), _contiguous(k[:, :anchor + 1]),
                              _contiguous(v[:, :anchor + 1]), softmax_scale=softmax_scale)
        last = min(row + gamma, split - start)
        correction = dense - out[:, row:row + 1]
        out[:, row:last] = out[:, row:last] + correction
    return out


def _needed_keys(policy, start, end, total):
    """Boolean [total]: the global key positions that causal query rows [start, end) read under `policy` (SINK_WINDOW
    or BLOCK_SPARSE, no Δ): sinks and the window reaching back from `start`; or the key blocks the rows' mask rows
    keep (any batch entry or head)."""
    needed = numpy.zeros(total, dtype=bool)
    if isinstance(policy, SinkWindow):
        needed[:min(policy.sink_tokens, end)] = True
        needed[max(0, start - policy.window + 1):end] = True
        return needed
    mask = policy.mask[:, :, start // policy.block_q:-(-end // policy.block_q), :-(-end // policy.block_k)]
    columns = mask.amax(dim=(0, 1, 2)) if hasattr(mask, "amax") else numpy.max(mask, axis=(0, 1, 2))
    columns = numpy.asarray(columns.cpu() if hasattr(columns, "cpu") else columns).astype(bool)
    needed[:end] = numpy.repeat(columns, policy.block_k)[:end]
    return needed


def prefill_exchange_plan(total, size, policy=None):
    """What each rank sends each other rank in prefill(): plan[src][dst] = the global positions (ascending int64) of
    src's tokens that dst's query rows read under `policy`, or None when every rank receives all other ranks'
    tokens (DENSE, Δ, SPARGE and the others: an all-gather). Deterministic from the arguments, so every rank computes
    the same plan without exchanging it."""
    if getattr(policy, "delta", None) is not None or not isinstance(policy, (SinkWindow, BlockSparse)):
        return None
    owned = []
    needs = []
    for r in range(size):
        mine = numpy.zeros(total, dtype=bool)
        need = numpy.zeros(total, dtype=bool)
        for start, end in zigzag_ranges(total, size, r):
            mine[start:end] = True
            need |= _needed_keys(policy, start, end, total)
        owned.append(mine)
        needs.append(need & ~mine)
    return [[numpy.flatnonzero(owned[src] & needs[dst]) if src != dst else numpy.zeros(0, numpy.int64)
             for dst in range(size)] for src in range(size)]


def _local_rows(ranges, chunk, positions):
    """Global positions a rank holds (its zig-zag ranges, `chunk` tokens each) → indices into its [2·chunk] rows."""
    local = numpy.empty(len(positions), dtype=numpy.int64)
    for i, (start, end) in enumerate(ranges):
        inside = (positions >= start) & (positions < end)
        local[inside] = positions[inside] - start + i * chunk
    return local


def _take_rows(x, rows):
    if type(x).__module__.split(".")[0] == "torch":
        import torch
        return x[:, torch.as_tensor(rows, device=x.device)].transpose(0, 1).contiguous()
    return numpy.ascontiguousarray(numpy.swapaxes(x[:, rows], 0, 1))


def _zeros_rows(x, total):
    if type(x).__module__.split(".")[0] == "torch":
        import torch
        return torch.zeros((x.shape[0], total, *x.shape[2:]), dtype=x.dtype, device=x.device)
    return numpy.zeros((x.shape[0], total, *x.shape[2:]), dtype=x.dtype)


def _put_rows(full, positions, rows):
    """full[:, positions] = rows ([n, B, ...], as _take_rows gives them)."""
    if type(full).__module__.split(".")[0] == "torch":
        import torch
        full[:, torch.as_tensor(positions, device=full.device)] = rows.transpose(0, 1)
    else:
        full[:, positions] = numpy.swapaxes(rows, 0, 1)


def _exchange_needed(group, x, plan, total):
    """[B, total, ...] with this rank's own tokens and the other ranks' tokens it reads (plan), zeros elsewhere
    (positions the policy never reads)."""
    size, rank = group.size, group.rank
    ranges = zigzag_ranges(total, size, rank)
    chunk = ranges[0][1] - ranges[0][0]
    full = _zeros_rows(x, total)
    for i, (start, end) in enumerate(ranges):
        full[:, start:end] = x[:, i * chunk:(i + 1) * chunk]
    parts = [_take_rows(x, _local_rows(ranges, chunk, plan[rank][dst])) for dst in range(size)]
    received = group.all_to_all(parts, [len(plan[src][rank]) for src in range(size)])
    for src in range(size):
        if len(plan[src][rank]):
            _put_rows(full, plan[src][rank], received[src])
    return full


def prefill(ctx, group, q, k, v, policy=None, *, total, softmax_scale=0.0):
    """Causal prefill of one batch of sequences of `total` tokens split zig-zag: q/k/v [B, 2·c, H, D] hold this
    rank's two chunks (zigzag_ranges) one after the other. Each rank receives the other ranks' K/V rows its query
    rows read: for SINK_WINDOW and BLOCK_SPARSE (without Δ) only those (prefill_exchange_plan, through the group's
    all_to_all where it has one), otherwise all of them (all-gather). Each chunk's rows attend over the key prefix up
    to their own last position (bottom-right causal alignment makes that the global causal mask), so a rank
    computes only the pairs the policy keeps. Supported: DENSE, SINK_WINDOW, BLOCK_SPARSE (the global mask
    [B, Hq, ceil(total/bq), ceil(total/bk)]; chunks multiples of block_q), and Δ on SINK_WINDOW or BLOCK_SPARSE
    (chunks multiples of gamma), and SPARGE without Δ (chunks multiples of block_q): its prediction centres K by the
    mean over the whole sequence and its top-k variant counts all key blocks, so each chunk runs over every key with
    query_offsets = the chunk's start, which places its rows and predicts the whole sequence's mask rows
    (docs/context_parallel.md). Returns this rank's out [B, 2·c, Hq, D]."""
    policy = policy if policy is not None else Dense()
    if not isinstance(policy, (Dense, SinkWindow, BlockSparse, Sparge)):
        raise NotImplementedError(f"prefill: {policy!r} is not supported (DENSE, SINK_WINDOW, BLOCK_SPARSE, "
                                  "with or without Δ, and SPARGE are)")
    if isinstance(policy, Sparge) and policy.delta is not None:
        raise NotImplementedError("prefill: SPARGE with Δ is not supported (query_offsets excludes Δ)")
    ranges = [zigzag_ranges(total, group.size, r) for r in range(group.size)]
    chunk = ranges[0][0][1] - ranges[0][0][0]
    plan = prefill_exchange_plan(total, group.size, policy) if hasattr(group, "all_to_all") else None
    if plan is not None:
        full_k, full_v = _exchange_needed(group, k, plan, total), _exchange_needed(group, v, plan, total)
    else:
        gathered_k, gathered_v = group.all_gather(k), group.all_gather(v)
        pieces_k, pieces_v, starts = [], [], []
        for r in range(group.size):
            for i, (start, _) in enumerate(ranges[r]):
                starts.append(start)
                pieces_k.append(gathered_k[r][:, i * chunk:(i + 1) * chunk])
                pieces_v.append(gathered_v[r][:, i * chunk:(i + 1) * chunk])
        order = sorted(range(len(starts)), key=lambda j: starts[j])
        full_k = _concat([pieces_k[j] for j in order], 1)
        full_v = _concat([pieces_v[j] for j in order], 1)
    base = copy.copy(policy)
    base.delta = None
    outs = []
    for i, (start, end) in enumerate(ranges[group.rank]):
        q_chunk = _contiguous(q[:, i * chunk:(i + 1) * chunk])
        chunk_policy = _chunk_policy(base, start, end, chunk)
        if policy.delta is not None:
            outs.append(_delta_chunk(ctx, q_chunk, full_k, full_v, chunk_policy, policy.delta, start, end, total,
                                     softmax_scale))
        elif isinstance(policy, Sparge):
            _block_aligned(policy, start, chunk)
            offsets = _like(q_chunk, numpy.full(q_chunk.shape[0], start, numpy.int32))
            outs.append(ops.attention(ctx, q_chunk, full_k, full_v, policy=chunk_policy, causal=True,
                                      softmax_scale=softmax_scale, query_offsets=offsets))
        else:
            outs.append(ops.attention(ctx, q_chunk, full_k[:, :end], full_v[:, :end], policy=chunk_policy,
                                      causal=True, softmax_scale=softmax_scale))
    return _concat(outs, 1)


def _contiguous(x):
    return x.contiguous() if hasattr(x, "contiguous") else numpy.ascontiguousarray(x)


__all__ = ["TorchGroup", "ThreadGroup", "token_select_indices", "cp_decode", "merge_gathered", "zigzag_ranges",
           "prefill", "prefill_exchange_plan"]
