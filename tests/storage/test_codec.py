"""storage.codec: LZ4 frames decoded into caller buffers equal python-lz4's output; XXH3 equals xxhash."""
from __future__ import annotations

import lz4.frame
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from storage import codec
from storage.shards import ShardError, decode_block, decode_tokens, encode_tokens

SIZES = [lz4.frame.BLOCKSIZE_MAX64KB, lz4.frame.BLOCKSIZE_MAX256KB, lz4.frame.BLOCKSIZE_MAX1MB]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 300_000), alphabet=st.sampled_from([2, 50, 65536]),
       linked=st.booleans(), size=st.sampled_from(SIZES), content_sum=st.booleans(), block_sum=st.booleans(),
       store_size=st.booleans())
def test_decompress_into_equals_python_lz4(seed, n, alphabet, linked, size, content_sum, block_sum, store_size):
    data = np.random.default_rng(seed).integers(0, alphabet, n).astype(np.uint16).tobytes()
    frame = lz4.frame.compress(data, block_size=size, block_linked=linked, content_checksum=content_sum,
                               block_checksum=block_sum, store_size=store_size)
    arena = np.full(len(data) + 64, 0xAB, dtype=np.uint8)
    out = arena[:len(data) + 16]  # LZ4 may scribble past the decoded size, never past the buffer
    assert codec.decompress_into(frame, out) == len(data)
    assert out[:len(data)].tobytes() == lz4.frame.decompress(frame) == data
    assert (arena[len(out):] == 0xAB).all(), "wrote past the output buffer"


def test_malformed_frames_raise_frame_error():
    data = np.arange(50_000, dtype=np.uint16).tobytes()
    frame = lz4.frame.compress(data, content_checksum=True)
    out = np.empty(len(data), dtype=np.uint8)
    with pytest.raises(codec.FrameError, match="magic"):
        codec.decompress_into(b"\0" * 32, out)
    with pytest.raises(codec.FrameError, match="truncated"):
        codec.decompress_into(frame[:len(frame) // 2], out)
    with pytest.raises(codec.FrameError, match="too small|more than|holds"):
        codec.decompress_into(frame, np.empty(len(data) - 1, dtype=np.uint8))
    bad = bytearray(frame)
    bad[len(bad) // 2] ^= 0xFF
    with pytest.raises(codec.FrameError):  # corrupt block, or caught by the content checksum
        codec.decompress_into(bytes(bad), out)
    header = bytearray(frame)
    header[5] ^= 0x01  # block-size byte: the header checksum no longer matches
    with pytest.raises(codec.FrameError, match="header checksum"):
        codec.decompress_into(bytes(header), out)


def test_xxh3_matches_xxhash():
    rng = np.random.default_rng(1)
    for n in (0, 1, 17, 4096, 1 << 20):
        buf = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert codec.xxh3_64(buf) == xxhash.xxh3_64_intdigest(buf)
        assert codec.xxh3_64(memoryview(buf)[1:]) == xxhash.xxh3_64_intdigest(buf[1:])


def _block(tokens, key_order=None):
    payload = encode_tokens(tokens, np.dtype("<u2"))
    meta = {"format": 1, "source": "web", "dtype": "uint16", "n_tokens": len(tokens),
            "xxh3_64": xxhash.xxh3_64_hexdigest(payload), "doc_ids": ["a"], "offsets": [0, len(tokens)]}
    if key_order:
        meta = {k: meta[k] for k in key_order}
    import json
    return payload, json.dumps(meta, separators=(",", ":")).encode()


def test_decode_tokens_reads_the_header_fields_in_any_layout():
    tokens = np.random.default_rng(2).integers(0, 65535, 10_000).astype(np.uint16)
    for order in (None, ["offsets", "doc_ids", "xxh3_64", "n_tokens", "dtype", "source", "format"]):
        payload, meta = _block(tokens, order)
        out = np.empty(12_000, dtype=np.uint16)
        got = decode_tokens("s.tar", "k", payload, meta, 0, out)
        np.testing.assert_array_equal(got, tokens)
        np.testing.assert_array_equal(got, decode_block("s.tar", "k", payload, meta, 0).tokens)
        bad = bytearray(payload)
        bad[-20] ^= 1
        with pytest.raises(ShardError, match="s.tar, member k.tokens.lz4, offset 0: checksum mismatch"):
            decode_tokens("s.tar", "k", bytes(bad), meta, 0, out)
    with pytest.raises(ShardError, match="expected at most 100"):
        decode_tokens("s.tar", "k", payload, meta, 0, np.empty(100, dtype=np.uint16))
