"""Training and evaluation samples of the fidelity model (numpy only, so the CPU harness can use it without torch).

Every sample is `length` bytes of real text (a random slice of a byte stream), and for the long-range tasks some
needles inserted at chosen depths and a question at the end, whose answer bytes are the last bytes of the sample:

- passkey: "The pass key is 48213. Remember it. " at a depth in [0, 1) of the haystack; the sample ends with
  "What is the pass key? The pass key is 48213." (answer: the 5 digits).
- multikey (associative recall): N_PAIRS needles "[key QZXW is 7281] " at random depths; the sample ends with
  "[key QZXW is 7281]" for one of them (answer: the 4 digits).

`answer_mask` marks the answer bytes (the targets whose prediction measures retrieval).
"""
import numpy as np

PASSKEY_DIGITS = 5
MULTIKEY_DIGITS = 4
MULTIKEY_PAIRS = 8
MULTIKEY_NEEDLE_BYTES = len(b"[key ABCD is 0123] ")
KEY_LETTERS = np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ", dtype=np.uint8)


def _digits(rng, n):
    return bytes(rng.integers(ord("0"), ord("9") + 1, size=n).astype(np.uint8))


def _haystack(rng, text, length):
    start = int(rng.integers(0, len(text) - length))
    return bytes(text[start:start + length])


def _insert(hay, needles):
    """needles: list of (depth in [0, 1), bytes); inserted at the nearest preceding space of each depth."""
    out, cursor = [], 0
    for depth, needle in sorted(needles, key=lambda n: n[0]):
        pos = max(cursor, min(len(hay), int(depth * len(hay))))
        space = hay.rfind(b" ", cursor, pos)
        pos = space + 1 if space >= cursor and pos - space < 64 else pos
        out += [hay[cursor:pos], needle]
        cursor = pos
    out.append(hay[cursor:])
    return b"".join(out)


def passkey_sample(rng, text, length, depth=None):
    """(bytes of `length`, answer_mask bool [length]) with the pass key at `depth` (random when None)."""
    key = _digits(rng, PASSKEY_DIGITS)
    depth = float(rng.random()) if depth is None else depth
    needle = b"The pass key is " + key + b". Remember it. "
    question = b" What is the pass key? The pass key is " + key + b"."
    hay = _haystack(rng, text, length)[:length - len(needle) - len(question)]
    sample = _insert(hay, [(depth, needle)]) + question
    mask = np.zeros(length, dtype=bool)
    mask[length - 1 - PASSKEY_DIGITS:length - 1] = True
    return sample, mask


def multikey_pairs(length):
    """MULTIKEY_PAIRS, fewer where the needles would fill more than half of a short sample (a training curriculum's
    first contexts): 8 pairs from 336 bytes on."""
    return max(1, min(MULTIKEY_PAIRS, length // (2 * MULTIKEY_NEEDLE_BYTES)))


def multikey_sample(rng, text, length, depth=None, pairs=None):
    """(bytes, answer_mask): `pairs` key/value needles (multikey_pairs(length) when None), the asked one at `depth`
    (random when None)."""
    pairs = multikey_pairs(length) if pairs is None else pairs
    keys = set()
    while len(keys) < pairs:
        keys.add(bytes(rng.choice(KEY_LETTERS, size=4)))
    keys = sorted(keys)
    values = [_digits(rng, MULTIKEY_DIGITS) for _ in keys]
    asked = int(rng.integers(0, pairs))
    depths = [float(rng.random()) for _ in keys]
    if depth is not None:
        depths[asked] = depth
    needles = [(d, b"[key " + k + b" is " + v + b"] ") for d, k, v in zip(depths, keys, values)]
    question = b" [key " + keys[asked] + b" is " + values[asked] + b"]"
    budget = length - sum(len(n) for _, n in needles) - len(question)
    hay = _haystack(rng, text, length)[:budget]
    sample = _insert(hay, needles) + question
    mask = np.zeros(length, dtype=bool)
    mask[length - 1 - MULTIKEY_DIGITS:length - 1] = True
    return sample, mask


def text_sample(rng, text, length):
    return _haystack(rng, text, length), np.zeros(length, dtype=bool)


def batch(rng, text, batch_size, length, task_mix=(0.5, 0.25, 0.25)):
    """tokens uint8 [batch, length], answer_mask bool [batch, length]: text / passkey / multikey drawn by task_mix."""
    tokens = np.empty((batch_size, length), dtype=np.uint8)
    masks = np.empty((batch_size, length), dtype=bool)
    makers = (text_sample, passkey_sample, multikey_sample)
    for i in range(batch_size):
        maker = makers[int(rng.choice(3, p=task_mix))]
        sample, mask = maker(rng, text, length)
        assert len(sample) == length, (maker.__name__, len(sample), length)
        tokens[i] = np.frombuffer(sample, dtype=np.uint8)
        masks[i] = mask
    return tokens, masks


def load_bytes(path):
    return np.fromfile(path, dtype=np.uint8)
