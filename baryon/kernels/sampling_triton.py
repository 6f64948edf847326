"""Logit processing for sampling as Triton kernels: penalties, top-k/top-p without a sort, min-p,
and the draw itself (the exponential race, one pass over the logits).

The torch functions in sampling.py stay the reference and the CPU path; these kernels keep their
semantics (differences on exact ties and float rounding below).

Top-k / top-p find each row's threshold logit T and keep the tokens >= T, never sorting. Each row
is cut into splits (so a batch of one still fills the GPU), and 4 + NUM_LEVELS launches do it:

1. per split, the largest and the smallest finite logit;
2. NUM_LEVELS counting levels: per split, each logit's bucket among NUM_PIVOTS evenly spaced
   pivots across the row's current bracket on T (a histogram gives how many logits are >= each
   pivot; a one-hot sum their probability mass, exp(logit - row max), when top-p needs it). The
   next kernel sums the splits (in split order, so every program agrees to the bit) and narrows
   the bracket to the two pivots around T: top-k's T while the row has a top-k, else top-p's;
3. per split, the logits the exact search needs are copied to a per-row scratch row, after those
   of the splits before (offsets from the counts): the logits inside the bracket, or for top-k
   every logit from its lower end up (top-p then searches above top-k's threshold);
4. per row, the exact search on the scratch row: logits map to integer keys that order like the
   floats, and each pass splits the key bracket at NUM_PIVOTS pivots, stopping once the bracket
   holds one logit (or exactly k for top-k): at most ceil(32 / log2(NUM_PIVOTS)) passes, and
   only over the few logits left in the bracket;
5. per block, logits >= T are copied and the rest set to -inf.

Top-k's predicate is "at least k logits >= t"; top-p's is "the mass of the logits >= t is at
least top_p times the mass kept by top-k": T is the largest t that passes, so the kept set is
exactly the reference's. Differences:

- Exact ties at top-p's threshold: every token equal to the last token top-p needs is kept; the
  reference ranks ties in sort order and may drop some of them. (Top-k ties match: both keep
  every token equal to the k-th largest.)
- Mass sums are float32 in another order than the reference's cumsum, so a top_p within float
  rounding (~1e-6 relative) of a prefix mass may keep one token more or one fewer.
- Rows must be free of NaN and +inf (-inf, e.g. a banned token, is fine).
"""

from __future__ import annotations

import torch

from baryon.kernels.triton_utils import TritonKernel, multiprocessor_count, next_power_of_2, tl, triton

NUM_PIVOTS = 16  # pivots per counting level and per search pass
NUM_LEVELS = 2  # parallel counting levels before the search: bracket ~ row range / 15**2
PIVOT_BLOCK = 1024  # logits per step of a counting loop
PIVOT_WARPS = 4  # warps of a counting program
SEARCH_BLOCK = 256  # logits per step of the exact search ([NUM_PIVOTS, SEARCH_BLOCK] accumulators)
ROW_BLOCK = 1024  # logits per step of the other passes
MIN_SPLIT = 4096  # fewest logits per program of a split pass on a GPU
PROGRAMS_PER_SM = 16  # split passes aim at this many programs per SM (memory parallelism)


if triton is not None:

    @triton.jit
    def _penalties_kernel(logits, prompt_mask, output_counts, presence, frequency, repetition, out,
                          stride_logits, stride_mask, stride_counts, stride_out, VOCAB, BLOCK: tl.constexpr):
        """logits, output_counts, out: [B, V] (unit column stride); prompt_mask: [B, V] uint8;
        presence, frequency, repetition: [B] float32. Grid: (B, cdiv(V, BLOCK))."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
        in_row = cols < VOCAB
        x = tl.load(logits + row * stride_logits + cols, mask=in_row, other=0.0).to(tl.float32)
        counts = tl.load(output_counts + row * stride_counts + cols, mask=in_row, other=0).to(tl.float32)
        in_prompt = tl.load(prompt_mask + row * stride_mask + cols, mask=in_row, other=0) != 0
        repetition_row = tl.load(repetition + row).to(tl.float32)
        generated = counts > 0
        penalised = tl.where(x > 0, tl.math.div_rn(x, repetition_row), x * repetition_row)
        x = tl.where(in_prompt | generated, penalised, x)
        x = x - tl.load(frequency + row).to(tl.float32) * counts
        x = x - tl.load(presence + row).to(tl.float32) * generated.to(tl.float32)
        tl.store(out + row * stride_out + cols, x.to(out.dtype.element_ty), mask=in_row)

    @triton.jit
    def _split_range_kernel(values, stride_values, split_max, split_min, VOCAB: tl.constexpr,
                            SPLIT_LEN: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
        """values: [B, V] (unit column stride) -> split_max, split_min: [B, SPLITS] float32, the
        largest value and the smallest finite one (+inf if none) of each SPLIT_LEN columns.
        Grid: (B, SPLITS)."""
        row = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        largest = tl.full([BLOCK], float("-inf"), tl.float32)
        smallest = tl.full([BLOCK], float("inf"), tl.float32)
        for offset in range(0, SPLIT_LEN, BLOCK):
            cols = split * SPLIT_LEN + offset + tl.arange(0, BLOCK)
            x = tl.load(values + row * stride_values + cols, mask=cols < VOCAB, other=float("-inf")).to(tl.float32)
            largest = tl.maximum(largest, x)
            smallest = tl.minimum(smallest, tl.where(x == float("-inf"), float("inf"), x))
        tl.store(split_max + row * SPLITS + split, tl.max(largest, axis=0))
        tl.store(split_min + row * SPLITS + split, tl.min(smallest, axis=0))

    @triton.jit
    def _row_range(split_max, split_min, row, SPLITS: tl.constexpr):
        """(largest, smallest finite) value of a row from its [SPLITS] split partials."""
        largest = tl.load(split_max + row * SPLITS)
        smallest = tl.load(split_min + row * SPLITS)
        for split in range(1, SPLITS):
            largest = tl.maximum(largest, tl.load(split_max + row * SPLITS + split))
            smallest = tl.minimum(smallest, tl.load(split_min + row * SPLITS + split))
        return largest, smallest

    @triton.jit
    def _min_p_kernel(probs, split_max, min_p, out, stride_probs, stride_out, VOCAB, SPLITS: tl.constexpr,
                      BLOCK: tl.constexpr):
        """probs, out: [B, V] (unit column stride); split_max: [B, SPLITS]; min_p: [B].
        Grid: (B, cdiv(V, BLOCK)). Zeroes the probabilities below min_p times the row's largest."""
        row = tl.program_id(0).to(tl.int64)
        largest, _ = _row_range(split_max, split_max, row, SPLITS)
        threshold = largest * tl.load(min_p + row).to(tl.float32)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        values = tl.load(probs + row * stride_probs + cols, mask=cols < VOCAB, other=0.0)
        kept = tl.where(values.to(tl.float32) < threshold, 0.0, values)
        tl.store(out + row * stride_out + cols, kept.to(out.dtype.element_ty), mask=cols < VOCAB)

    @triton.jit
    def _ordered_key(values):
        """float32 [...] -> int64 [...]: integer keys in [-2**31, 2**31) that order like the floats
        (the sign bit flips the order of the other bits of negative values)."""
        bits = values.to(tl.int32, bitcast=True)
        return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)

    @triton.jit
    def _key_value(keys):
        """The inverse of _ordered_key: int64 keys in [-2**31, 2**31) -> float32."""
        keys32 = keys.to(tl.int32)
        return tl.where(keys32 >= 0, keys32, keys32 ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)

    @triton.jit
    def _row_params(top_k, top_p, row, VOCAB: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr):
        """(k, p, k_active, p_active) of a row: k in 1..VOCAB (VOCAB: off), p (1: off)."""
        k = tl.full([], VOCAB, tl.int64)
        if HAS_TOP_K:
            k = tl.load(top_k + row).to(tl.int64)
            k = tl.where((k > 0) & (k < VOCAB), k, VOCAB)
        p = tl.full([], 1.0, tl.float32)
        if HAS_TOP_P:
            p = tl.load(top_p + row).to(tl.float32)
        return k, p, k < VOCAB, p < 1.0

    @triton.jit
    def _level_pivots(lower, upper, row_max, NUM_PIVOTS: tl.constexpr):
        """[NUM_PIVOTS] float32 ascending, evenly spaced from lower to upper (row_max when upper is
        +inf), both ends included."""
        index = tl.arange(0, NUM_PIVOTS)
        top = tl.where(upper == float("inf"), row_max, upper)
        lower = tl.where(lower == float("-inf"), top, lower)  # a finished bracket: no inf - inf
        pivots = lower + (top - lower) * (index.to(tl.float32) / (NUM_PIVOTS - 1))  # rounding keeps the order
        return tl.where(index == NUM_PIVOTS - 1, top, tl.minimum(pivots, top))

    @triton.jit
    def _initial_bracket(split_max, split_min, row, k_active, SPLITS: tl.constexpr):
        """A row's bracket before any level: [smallest finite logit, +inf), from its split ranges.
        A bracket is (lower, upper, row_max, count_lo: logits >= lower, count_above: logits >=
        upper, mass_above: their summed exp(logit - row_max), total_mass: the row's, best: lower's
        pivot index at the level that set it, use_k: it brackets top-k's threshold, else top-p's);
        the threshold lies in [lower, upper), and lower = -inf means it is -inf (keep all)."""
        row_max, row_min = _row_range(split_max, split_min, row, SPLITS)
        lower = tl.where(row_max > float("-inf"), row_min, float("-inf"))  # no finite logit: keep all
        row_max = tl.where(row_max > float("-inf"), row_max, 0.0)  # the shift of exp(logit - row_max)
        upper = tl.full([], float("inf"), tl.float32)
        zero = tl.zeros([], tl.int32)
        return lower, upper, row_max, zero, zero, 0.0 * row_max, 0.0 * row_max, zero, k_active.to(tl.int32)

    @triton.jit
    def _store_bracket(bracket_values, bracket_counts, stage, row, num_rows, lower, upper, row_max, count_lo,
                       count_above, mass_above, total_mass, best, use_k):
        """Save a bracket at stage (0..NUM_LEVELS - 1: before that level; NUM_LEVELS: the final
        one) to bracket_values [NUM_LEVELS + 1, B, 5] float32 and bracket_counts [.., B, 4] int32."""
        values = bracket_values + (stage * num_rows + row) * 5
        counts = bracket_counts + (stage * num_rows + row) * 4
        tl.store(values, lower)
        tl.store(values + 1, upper)
        tl.store(values + 2, row_max)
        tl.store(values + 3, mass_above)
        tl.store(values + 4, total_mass)
        tl.store(counts, count_lo)
        tl.store(counts + 1, count_above)
        tl.store(counts + 2, best)
        tl.store(counts + 3, use_k)

    @triton.jit
    def _load_bracket(bracket_values, bracket_counts, stage, row, num_rows):
        """The bracket _store_bracket saved (in _initial_bracket's order)."""
        values = bracket_values + (stage * num_rows + row) * 5
        counts = bracket_counts + (stage * num_rows + row) * 4
        return (tl.load(values), tl.load(values + 1), tl.load(values + 2), tl.load(counts),
                tl.load(counts + 1), tl.load(values + 3), tl.load(values + 4), tl.load(counts + 2),
                tl.load(counts + 3))

    @triton.jit
    def _narrow_bracket(bracket_values, bracket_counts, pivot_counts, pivot_masses, row, num_rows, k, p, p_active,
                        LEVEL: tl.constexpr, SPLITS: tl.constexpr, NUM_PIVOTS: tl.constexpr):
        """The bracket saved before LEVEL, narrowed by that level's split counts (pivot_counts,
        pivot_masses: [NUM_LEVELS, B, SPLITS, NUM_PIVOTS]) to the two pivots around the threshold
        (top-k's while use_k, else top-p's)."""
        lower, upper, row_max, count_lo, count_above, mass_above, total_mass, best, use_k = _load_bracket(
            bracket_values, bracket_counts, LEVEL, row, num_rows)
        pivot_index = tl.arange(0, NUM_PIVOTS)
        pivots = _level_pivots(lower, upper, row_max, NUM_PIVOTS)
        counts = tl.zeros([NUM_PIVOTS], tl.int32)
        masses = tl.zeros([NUM_PIVOTS], tl.float32)
        for split in range(SPLITS):  # in split order: every program sums to the same bits
            part = ((LEVEL * num_rows + row) * SPLITS + split) * NUM_PIVOTS + pivot_index
            counts += tl.load(pivot_counts + part)
            masses += tl.load(pivot_masses + part)
        if LEVEL == 0:  # pivot 0 is the smallest finite logit
            total_mass = tl.sum(tl.where(pivot_index == 0, masses, 0.0), axis=0)
            # k beyond the finite logits: top-k keeps them all; what is left is top-p's (or nothing)
            use_k = use_k & (tl.sum(tl.where(pivot_index == 0, counts, 0), axis=0) >= k).to(tl.int32)
            lower = tl.where((use_k != 0) | p_active, lower, float("-inf"))
        # (tl.where, not & or |, mixes scalar and vector conditions: the interpreter needs it)
        holds = tl.where(use_k != 0, counts >= k, masses >= p * total_mass)
        if LEVEL > 0:
            holds = holds | (pivot_index == 0)  # lower held at the level before
        holds = holds & tl.where(upper == float("inf"), pivot_index >= 0, pivot_index < NUM_PIVOTS - 1)
        level_best = tl.max(tl.where(holds, pivot_index, -1), axis=0)  # -1: the threshold is -inf
        at_best, at_next = pivot_index == level_best, pivot_index == level_best + 1
        done = lower == float("-inf")
        narrows_top = ~done & (level_best + 1 < NUM_PIVOTS)
        lower = tl.where(done | (level_best < 0), float("-inf"),
                         tl.max(tl.where(at_best, pivots, float("-inf")), axis=0))
        count_lo = tl.where(done, count_lo, tl.sum(tl.where(at_best, counts, 0), axis=0))
        upper = tl.where(narrows_top, tl.max(tl.where(at_next, pivots, float("-inf")), axis=0), upper)
        count_above = tl.where(narrows_top, tl.sum(tl.where(at_next, counts, 0), axis=0), count_above)
        mass_above = tl.where(narrows_top, tl.sum(tl.where(at_next, masses, 0.0), axis=0), mass_above)
        best = tl.where(done, best, level_best)
        return lower, upper, row_max, count_lo, count_above, mass_above, total_mass, best, use_k

    @triton.jit
    def _count_span(row_values, start, VOCAB: tl.constexpr, SPAN: tl.constexpr, pivots, shift,
                    WITH_MASS: tl.constexpr, NUM_PIVOTS: tl.constexpr, BLOCK: tl.constexpr):
        """Over row_values[start:start + SPAN] (cut at VOCAB), for ascending pivots [NUM_PIVOTS]:
        (counts [NUM_PIVOTS] int32 of the values >= each pivot, masses [NUM_PIVOTS] float32: their
        summed exp(value - shift), or zeros without WITH_MASS)."""
        pivot_index = tl.arange(0, NUM_PIVOTS)
        in_bucket = tl.zeros([NUM_PIVOTS], tl.int32)  # bucket j: values in [pivots[j], pivots[j + 1])
        bucket_mass = tl.zeros([NUM_PIVOTS], tl.float32)
        for offset in range(0, SPAN, BLOCK):
            cols = start + offset + tl.arange(0, BLOCK)
            x = tl.load(row_values + cols, mask=cols < VOCAB, other=float("-inf")).to(tl.float32)  # [BLOCK]
            # Each logit's bucket: the last pivot at or below it (-1: below them all).
            bucket = tl.sum((x[None, :] >= pivots[:, None]).to(tl.int32), axis=0) - 1  # [BLOCK]
            counted = (cols < VOCAB) & (bucket >= 0)
            in_bucket += tl.histogram(bucket, NUM_PIVOTS, mask=counted)
            if WITH_MASS:
                one_hot = (bucket[None, :] == pivot_index[:, None]) & counted[None, :]  # [NUM_PIVOTS, BLOCK]
                bucket_mass += tl.sum(tl.where(one_hot, tl.exp(x - shift)[None, :], 0.0), axis=1)
        at_or_above = pivot_index[None, :] >= pivot_index[:, None]  # [j, i]: bucket i lies at or above pivot j
        return (tl.sum(tl.where(at_or_above, in_bucket[None, :], 0), axis=1),
                tl.sum(tl.where(at_or_above, bucket_mass[None, :], 0.0), axis=1))

    @triton.jit
    def _count_level_kernel(logits, stride_logits, top_k, top_p, split_max, split_min, pivot_counts, pivot_masses,
                            bracket_values, bracket_counts, num_rows, LEVEL: tl.constexpr, VOCAB: tl.constexpr,
                            SPLIT_LEN: tl.constexpr, SPLITS: tl.constexpr, HAS_TOP_K: tl.constexpr,
                            HAS_TOP_P: tl.constexpr, NUM_PIVOTS: tl.constexpr, BLOCK: tl.constexpr):
        """logits: [B, V] (unit column stride) -> pivot_counts, pivot_masses [NUM_LEVELS, B, SPLITS,
        NUM_PIVOTS] at LEVEL: per split, the logits >= each pivot of the row's bracket before
        LEVEL, and their summed exp(logit - row max) (when top-p needs them). The split-0 program
        saves that bracket (stage LEVEL). Grid: (B, SPLITS)."""
        row = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        k, p, k_active, p_active = _row_params(top_k, top_p, row, VOCAB, HAS_TOP_K, HAS_TOP_P)
        if k_active | p_active:
            if LEVEL == 0:
                lower, upper, row_max, count_lo, count_above, mass_above, total_mass, best, use_k = (
                    _initial_bracket(split_max, split_min, row, k_active, SPLITS))
            else:
                lower, upper, row_max, count_lo, count_above, mass_above, total_mass, best, use_k = _narrow_bracket(
                    bracket_values, bracket_counts, pivot_counts, pivot_masses, row, num_rows, k, p, p_active,
                    LEVEL - 1, SPLITS, NUM_PIVOTS)
            if split == 0:
                _store_bracket(bracket_values, bracket_counts, LEVEL, row, num_rows, lower, upper, row_max, count_lo,
                               count_above, mass_above, total_mass, best, use_k)
            if lower > float("-inf"):
                pivots = _level_pivots(lower, upper, row_max, NUM_PIVOTS)
                row_logits = logits + row * stride_logits
                needs_mass = use_k == 0
                if LEVEL == 0:  # level 0 may hand a row from top-k (k beyond its finite logits) to top-p
                    needs_mass = needs_mass | p_active
                if needs_mass:
                    counts, masses = _count_span(row_logits, split * SPLIT_LEN, VOCAB, SPLIT_LEN, pivots, row_max,
                                                 True, NUM_PIVOTS, BLOCK)
                else:
                    counts, masses = _count_span(row_logits, split * SPLIT_LEN, VOCAB, SPLIT_LEN, pivots, row_max,
                                                 False, NUM_PIVOTS, BLOCK)
                part = ((LEVEL * num_rows + row) * SPLITS + split) * NUM_PIVOTS + tl.arange(0, NUM_PIVOTS)
                tl.store(pivot_counts + part, counts)
                tl.store(pivot_masses + part, masses)

    @triton.jit
    def _candidates_before(pivot_counts, row, num_rows, end_split, best, only_inside, LAST_LEVEL: tl.constexpr,
                           SPLITS: tl.constexpr, NUM_PIVOTS: tl.constexpr):
        """How many logits splits [0, end_split) copy to the scratch row: those >= the bracket's
        lower end (pivot `best` of the last level), less those >= its upper end when only_inside."""
        total = tl.zeros([], tl.int32)
        for split in range(SPLITS):
            part = ((LAST_LEVEL * num_rows + row) * SPLITS + split) * NUM_PIVOTS + best
            inside = tl.load(pivot_counts + part)
            if only_inside:
                inside -= tl.load(pivot_counts + part + 1)
            total += tl.where(split < end_split, inside, 0)
        return total

    @triton.jit
    def _copy_candidates_kernel(logits, stride_logits, top_k, top_p, pivot_counts, pivot_masses, bracket_values,
                                bracket_counts, scratch, num_rows, VOCAB: tl.constexpr, SPLIT_LEN: tl.constexpr,
                                SPLITS: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
                                NUM_LEVELS: tl.constexpr, NUM_PIVOTS: tl.constexpr, BLOCK: tl.constexpr):
        """scratch: [B, V] float32 <- the logits the exact search needs, in column order: those in
        the final bracket [lower, upper), or all >= lower for top-k's bracket. The split-0
        program saves the final bracket (stage NUM_LEVELS). Grid: (B, SPLITS)."""
        row = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        k, p, k_active, p_active = _row_params(top_k, top_p, row, VOCAB, HAS_TOP_K, HAS_TOP_P)
        if k_active | p_active:
            lower, upper, row_max, count_lo, count_above, mass_above, total_mass, best, use_k = _narrow_bracket(
                bracket_values, bracket_counts, pivot_counts, pivot_masses, row, num_rows, k, p, p_active,
                NUM_LEVELS - 1, SPLITS, NUM_PIVOTS)
            if split == 0:
                _store_bracket(bracket_values, bracket_counts, NUM_LEVELS, row, num_rows, lower, upper, row_max,
                               count_lo, count_above, mass_above, total_mass, best, use_k)
            if lower > float("-inf"):
                only_inside = (use_k == 0) & (upper < float("inf"))
                slot = _candidates_before(pivot_counts, row, num_rows, split, best, only_inside, NUM_LEVELS - 1,
                                          SPLITS, NUM_PIVOTS)
                for offset in range(0, SPLIT_LEN, BLOCK):
                    cols = split * SPLIT_LEN + offset + tl.arange(0, BLOCK)
                    x = tl.load(logits + row * stride_logits + cols, mask=cols < VOCAB,
                                other=float("-inf")).to(tl.float32)
                    if tl.max(x, axis=0) >= lower:  # most blocks hold no candidate
                        at_or_above = (cols < VOCAB) & (x >= lower)
                        take = tl.where(only_inside, at_or_above & (x < upper), at_or_above).to(tl.int32)
                        slots = slot + tl.cumsum(take, axis=0) - 1
                        tl.store(scratch + row * VOCAB + slots, x, mask=(take != 0) & (slots < VOCAB))
                        slot += tl.sum(take, axis=0)

    @triton.jit
    def _count_at_pivots(values, length, pivots, shift, mass_floor, NUM_PIVOTS: tl.constexpr,
                         BLOCK: tl.constexpr):
        """values[0:length] (float32, unit stride); pivots: [NUM_PIVOTS] float32 ->
        (counts [NUM_PIVOTS] int32: values >= each pivot, masses [NUM_PIVOTS] float32: their
        summed exp(value - shift), mass of the values >= mass_floor: float32 scalar)."""
        count_acc = tl.zeros([NUM_PIVOTS, BLOCK], tl.int32)
        mass_acc = tl.zeros([NUM_PIVOTS, BLOCK], tl.float32)
        floor_acc = tl.zeros([BLOCK], tl.float32)
        start = 0
        while start < length:  # a while loop: the interpreter's range() takes no computed bounds
            offsets = start + tl.arange(0, BLOCK)
            valid = offsets < length
            x = tl.load(values + offsets, mask=valid, other=float("-inf"))  # [BLOCK]
            weight = tl.where(valid, tl.exp(x - shift), 0.0)
            above = (x[None, :] >= pivots[:, None]) & valid[None, :]  # [NUM_PIVOTS, BLOCK]
            count_acc += above.to(tl.int32)
            mass_acc += tl.where(above, weight[None, :], 0.0)
            floor_acc += tl.where(x >= mass_floor, weight, 0.0)
            start += BLOCK
        return tl.sum(count_acc, axis=1), tl.sum(mass_acc, axis=1), tl.sum(floor_acc, axis=0)

    @triton.jit
    def _search_keys(values, length, lo, hi, count_lo, count_above, count_offset, mass_offset, k, p, total_mass,
                     shift, mass_floor, TOP_P: tl.constexpr, NUM_PIVOTS: tl.constexpr, BLOCK: tl.constexpr):
        """The largest key t in [lo, hi] whose float keeps enough logits: the logits >= t are
        those of values[0:length] plus count_offset more (of mass mass_offset) above them; top-k
        needs >= k of them, top-p a mass >= p * Z, Z the mass of the values >= mass_floor (or
        total_mass when mass_floor is -inf). The predicate is taken to hold at lo and not at
        hi + 1; count_lo / count_above count the logits >= lo / > hi.
        Returns (a key whose float keeps the same logits as t, the count of those logits)."""
        pivot_index = tl.arange(0, NUM_PIVOTS).to(tl.int64)
        searching = (hi > lo) & (count_lo - count_above > 1)
        if not TOP_P:
            searching = searching & (count_lo != k)  # exactly k kept: that is the answer's set
        while searching:
            step = (hi - lo + NUM_PIVOTS) // NUM_PIVOTS  # ceil(width / NUM_PIVOTS), width = hi - lo + 1
            pivot_keys = lo + pivot_index * step  # [NUM_PIVOTS]
            in_bracket = pivot_keys <= hi
            pivots = _key_value(tl.minimum(pivot_keys, hi))
            counts, masses, floor_mass = _count_at_pivots(values, length, pivots, shift, mass_floor, NUM_PIVOTS,
                                                          BLOCK)
            counts += count_offset
            if TOP_P:
                needed = p * tl.where(mass_floor == float("-inf"), total_mass, floor_mass)
                holds = masses + mass_offset >= needed
            else:
                holds = counts >= k
            holds = (holds & in_bracket) | (pivot_index == 0)
            best = tl.max(tl.where(holds, pivot_index, 0), axis=0)
            next_in_bracket = (best + 1 < NUM_PIVOTS) & (lo + (best + 1) * step <= hi)
            count_lo = tl.sum(tl.where(pivot_index == best, counts, 0), axis=0)
            count_next = tl.sum(tl.where(pivot_index == best + 1, counts, 0), axis=0)
            count_above = tl.where(next_in_bracket, count_next, count_above)
            hi = tl.where(next_in_bracket, lo + (best + 1) * step - 1, hi)
            lo = lo + best * step
            searching = (hi > lo) & (count_lo - count_above > 1)
            if not TOP_P:
                searching = searching & (count_lo != k)
        return lo, count_lo

    @triton.jit
    def _threshold_kernel(top_k, top_p, pivot_counts, bracket_values, bracket_counts, scratch, threshold, num_rows,
                          VOCAB: tl.constexpr, SPLITS: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
                          NUM_LEVELS: tl.constexpr, NUM_PIVOTS: tl.constexpr, BLOCK: tl.constexpr):
        """threshold: [B] float32 <- the smallest logit each row keeps (-inf: all), by the exact
        key search on its scratch row within the final bracket: top-k's threshold, then top-p's
        above it. Grid: (B,)."""
        row = tl.program_id(0).to(tl.int64)
        k, p, k_active, p_active = _row_params(top_k, top_p, row, VOCAB, HAS_TOP_K, HAS_TOP_P)
        result = tl.full([], float("-inf"), tl.float32)
        if k_active | p_active:
            lower, upper, row_max, count_lo, count_above, mass_above, total_mass, best, use_k = _load_bracket(
                bracket_values, bracket_counts, NUM_LEVELS, row, num_rows)
            if lower > float("-inf"):
                only_inside = (use_k == 0) & (upper < float("inf"))
                num_candidates = _candidates_before(pivot_counts, row, num_rows, SPLITS, best, only_inside,
                                                    NUM_LEVELS - 1, SPLITS, NUM_PIVOTS)
                row_scratch = scratch + row * VOCAB
                lo = _ordered_key(lower)
                hi = tl.where(upper < float("inf"), _ordered_key(upper) - 1, _ordered_key(row_max))
                if use_k != 0:  # the scratch row holds every logit >= lower
                    lo, count_lo = _search_keys(row_scratch, num_candidates, lo, hi, count_lo, count_above, 0, 0.0,
                                                k, p, total_mass, row_max, float("-inf"), False, NUM_PIVOTS, BLOCK)
                    hi = _ordered_key(row_max)
                    count_above = tl.zeros([], tl.int32)
                if p_active:  # with top-k: above its threshold; alone: the bracket, the rest counted above
                    mass_floor = tl.where(use_k != 0, _key_value(lo), float("-inf"))
                    lo, count_lo = _search_keys(row_scratch, num_candidates, lo, hi, count_lo, count_above,
                                                tl.where(only_inside, count_above, 0),
                                                tl.where(only_inside, mass_above, 0.0), k, p, total_mass, row_max,
                                                mass_floor, True, NUM_PIVOTS, BLOCK)
                result = _key_value(lo)
        tl.store(threshold + row, result)

    @triton.jit
    def _mask_below_kernel(logits, threshold, out, stride_logits, stride_out, VOCAB, BLOCK: tl.constexpr):
        """out: [B, V] <- logits: [B, V] where >= threshold[row] ([B]), else -inf.
        Grid: (B, cdiv(V, BLOCK))."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(logits + row * stride_logits + cols, mask=cols < VOCAB, other=float("-inf"))
        kept = tl.where(x.to(tl.float32) >= tl.load(threshold + row), x, float("-inf"))
        tl.store(out + row * stride_out + cols, kept.to(out.dtype.element_ty), mask=cols < VOCAB)


if triton is not None:

    @triton.jit
    def _race_split_kernel(logits, stride_logits, temperature, greedy, seeds, split_key, split_id,
                           VOCAB: tl.constexpr, SPLIT_LEN: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
        """Per (row, split): the split's largest key and the first id holding it, key = logit /
        temperature - log(q) with q = -log(u), u uniform from Philox keyed by the row's seed and the
        token id (the same draw whatever the split layout or the batch); greedy rows: key = logit.
        An empty or fully masked split reports (-inf, VOCAB)."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        t = tl.load(temperature + row)
        is_greedy = tl.load(greedy + row) != 0
        seed = tl.load(seeds + row)
        best_key = tl.full([BLOCK], float("-inf"), tl.float32)
        best_id = tl.full([BLOCK], VOCAB, tl.int32)
        for start in range(split * SPLIT_LEN, (split + 1) * SPLIT_LEN, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(logits + row * stride_logits + cols, mask=cols < VOCAB, other=float("-inf")).to(tl.float32)
            u = tl.rand(seed, cols)
            key = tl.where(is_greedy, x, x / t - tl.log(-tl.log(u)))
            better = key > best_key  # strict: each lane keeps its first id of a tie (NaN never wins)
            best_key = tl.where(better, key, best_key)
            best_id = tl.where(better, cols, best_id)
        top = tl.max(best_key, axis=0)
        tl.store(split_key + row * SPLITS + split, top)
        tl.store(split_id + row * SPLITS + split, tl.min(tl.where(best_key == top, best_id, VOCAB), axis=0))

    @triton.jit
    def _race_noise_kernel(seeds, out, stride_out, VOCAB: tl.constexpr, BLOCK: tl.constexpr):
        """out[row, id] = -log(u): the Exp(1) noise _race_split_kernel draws for that row and id."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        u = tl.rand(tl.load(seeds + row), cols)
        tl.store(out + row * stride_out + cols, -tl.log(u), mask=cols < VOCAB)

    @triton.jit
    def _race_pick_kernel(split_key, split_id, out, VOCAB: tl.constexpr, SPLITS: tl.constexpr,
                          SPLITS_PADDED: tl.constexpr):
        """Per row: the id of the first split holding the largest key (ids grow with the splits, so
        the first id of a tie); 0 for a row with no finite key, as an argmax over -inf gives."""
        row = tl.program_id(0)
        splits = tl.arange(0, SPLITS_PADDED)
        keys = tl.load(split_key + row * SPLITS + splits, mask=splits < SPLITS, other=float("-inf"))
        ids = tl.load(split_id + row * SPLITS + splits, mask=splits < SPLITS, other=VOCAB)
        first = tl.min(tl.where(keys == tl.max(keys, axis=0), ids, VOCAB), axis=0)
        tl.store(out + row, tl.where(first < VOCAB, first, 0).to(tl.int64))


def _split_layout(rows: int, vocab: int, device: torch.device) -> tuple[int, int, int]:
    """(block, split_len, splits) for the split passes: on a GPU up to PROGRAMS_PER_SM programs
    per SM (a power of two splits per row, none under MIN_SPLIT logits); in the interpreter
    (tests) two splits, so small rows still cross a split boundary."""
    if device.type == "cuda":
        block = min(ROW_BLOCK, next_power_of_2(vocab))
        wanted = min(-(-PROGRAMS_PER_SM * multiprocessor_count(device) // rows), max(1, vocab // MIN_SPLIT))
        wanted = 1 << (wanted.bit_length() - 1)  # a power of two: few layouts, so few compilations
    else:
        block = min(ROW_BLOCK, max(16, next_power_of_2(-(-vocab // 2))))
        wanted = 2
    split_len = -(-vocab // (wanted * block)) * block  # a multiple of block
    return block, split_len, -(-vocab // split_len)


def _unit_column_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class TritonSampling(TritonKernel):
    """The sampling logit processors as Triton kernels (same semantics as sampling.py's torch ones)."""

    family = "sampling"

    @staticmethod
    def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                        presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
        """logits: [B, V] float32; prompt_mask: [B, V] bool; output_counts: [B, V];
        presence/frequency/repetition: [B] -> penalised logits [B, V] (see sampling.apply_penalties)."""
        rows, vocab = logits.shape
        logits, output_counts = _unit_column_stride(logits), _unit_column_stride(output_counts)
        prompt_mask = _unit_column_stride(prompt_mask).view(torch.uint8)
        out = torch.empty(rows, vocab, dtype=torch.promote_types(logits.dtype, frequency.dtype), device=logits.device)
        if rows and vocab:
            block = min(ROW_BLOCK, next_power_of_2(vocab))
            # No fused multiply-add: x - frequency * count rounds like torch's two operations.
            _penalties_kernel[(rows, triton.cdiv(vocab, block))](
                logits, prompt_mask, output_counts, presence, frequency, repetition, out, logits.stride(0),
                prompt_mask.stride(0), output_counts.stride(0), out.stride(0), vocab, BLOCK=block,
                enable_fp_fusion=False)
        return out

    @staticmethod
    def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                          top_p: torch.Tensor | None) -> torch.Tensor:
        """logits: [B, V]; top_k: [B] int (0 = all) or None; top_p: [B] float (1 = all) or None
        -> [B, V] with the dropped tokens at -inf (see sampling.apply_top_k_top_p)."""
        if top_k is None and top_p is None:
            return logits
        rows, vocab = logits.shape
        logits = _unit_column_stride(logits)
        out = torch.empty(rows, vocab, dtype=logits.dtype, device=logits.device)
        if not rows or not vocab:
            return out
        device = logits.device
        block, split_len, splits = _split_layout(rows, vocab, device)
        split_max = torch.empty(rows, splits, dtype=torch.float32, device=device)
        split_min = torch.empty_like(split_max)
        pivot_counts = torch.empty(NUM_LEVELS, rows, splits, NUM_PIVOTS, dtype=torch.int32, device=device)
        pivot_masses = torch.empty(NUM_LEVELS, rows, splits, NUM_PIVOTS, dtype=torch.float32, device=device)
        bracket_values = torch.empty(NUM_LEVELS + 1, rows, 5, dtype=torch.float32, device=device)
        bracket_counts = torch.empty(NUM_LEVELS + 1, rows, 4, dtype=torch.int32, device=device)
        scratch = torch.empty(rows, vocab, dtype=torch.float32, device=device)  # the search's candidates
        threshold = torch.empty(rows, dtype=torch.float32, device=device)
        row_params = (logits if top_k is None else top_k, logits if top_p is None else top_p)
        flags = dict(HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None)
        brackets = (bracket_values, bracket_counts)
        # Each bracket is saved once and pivots are computed without fused multiply-adds, so the
        # copy kernel's comparisons agree to the bit with the counts the levels stored.
        _split_range_kernel[(rows, splits)](logits, logits.stride(0), split_max, split_min, VOCAB=vocab,
                                            SPLIT_LEN=split_len, SPLITS=splits, BLOCK=block)
        for level in range(NUM_LEVELS):
            _count_level_kernel[(rows, splits)](
                logits, logits.stride(0), *row_params, split_max, split_min, pivot_counts, pivot_masses, *brackets,
                rows, LEVEL=level, VOCAB=vocab, SPLIT_LEN=split_len, SPLITS=splits, NUM_PIVOTS=NUM_PIVOTS,
                BLOCK=min(PIVOT_BLOCK, block), num_warps=PIVOT_WARPS, enable_fp_fusion=False, **flags)
        _copy_candidates_kernel[(rows, splits)](
            logits, logits.stride(0), *row_params, pivot_counts, pivot_masses, *brackets, scratch, rows, VOCAB=vocab,
            SPLIT_LEN=split_len, SPLITS=splits, NUM_LEVELS=NUM_LEVELS, NUM_PIVOTS=NUM_PIVOTS, BLOCK=block,
            enable_fp_fusion=False, **flags)
        _threshold_kernel[(rows,)](
            *row_params, pivot_counts, *brackets, scratch, threshold, rows, VOCAB=vocab, SPLITS=splits,
            NUM_LEVELS=NUM_LEVELS, NUM_PIVOTS=NUM_PIVOTS, BLOCK=min(SEARCH_BLOCK, block), num_warps=8, **flags)
        _mask_below_kernel[(rows, triton.cdiv(vocab, block))](logits, threshold, out, logits.stride(0),
                                                              out.stride(0), vocab, BLOCK=block)
        return out

    @staticmethod
    def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                         seeds: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> [B] int64 by the exponential race of sampling.sample_rows, in one pass
        over the logits (the noise made in registers from Philox streams, never stored), then one
        small kernel: the reference's distribution, not its draws."""
        rows, vocab = logits.shape
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
        if not rows:
            return out
        logits = _unit_column_stride(logits)
        block, split_len, splits = _split_layout(rows, vocab, logits.device)
        split_key = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
        split_id = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
        _race_split_kernel[(rows, splits)](logits, logits.stride(0), temperature, greedy.view(torch.uint8), seeds,
                                           split_key, split_id, VOCAB=vocab, SPLIT_LEN=split_len, SPLITS=splits,
                                           BLOCK=block)
        _race_pick_kernel[(rows,)](split_key, split_id, out, VOCAB=vocab, SPLITS=splits,
                                   SPLITS_PADDED=next_power_of_2(splits))
        return out

    @staticmethod
    def race_noise(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
        """seeds [B] -> [B, vocab] float32: the Exp(1) noise sample_rows draws with them."""
        out = torch.empty(len(seeds), vocab, dtype=torch.float32, device=seeds.device)
        if len(seeds) and vocab:
            block = min(ROW_BLOCK, next_power_of_2(vocab))
            _race_noise_kernel[(len(seeds), triton.cdiv(vocab, block))](seeds, out, out.stride(0), VOCAB=vocab,
                                                                        BLOCK=block)
        return out

    @staticmethod
    def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
        """probs: [B, V]; min_p: [B] (0 = off) -> probs with those below min_p * row max zeroed."""
        rows, vocab = probs.shape
        probs = _unit_column_stride(probs)
        out = torch.empty(rows, vocab, dtype=probs.dtype, device=probs.device)
        if rows and vocab:
            block, split_len, splits = _split_layout(rows, vocab, probs.device)
            split_max = torch.empty(rows, splits, dtype=torch.float32, device=probs.device)
            _split_range_kernel[(rows, splits)](probs, probs.stride(0), split_max, torch.empty_like(split_max),
                                                VOCAB=vocab, SPLIT_LEN=split_len, SPLITS=splits, BLOCK=block)
            _min_p_kernel[(rows, triton.cdiv(vocab, block))](probs, split_max, min_p, out, probs.stride(0),
                                                             out.stride(0), vocab, SPLITS=splits, BLOCK=block)
        return out
