"""Measurement-level syndromes: a compiled decoder that takes raw measurement records.

CUDA-Q's realtime ``enqueue_syndromes`` sends measurements, not detection events;
its decoder config's ``D_sparse`` says which measurements XOR into each detector.
:class:`MeasurementDecoder` wraps a detector-level compiled decoder with that map,
so a service serves it unchanged with one "syndrome bit" per measurement.

The map is linear over GF(2), so it is applied byte by byte on the bit-packed
record, with no unpacking: for byte position ``j`` of the record a table holds, for each
of the 256 byte values, the packed detector bits its set measurements flip, and a shot's
detection events are the XOR of ``ceil(num_measurements / 8)`` table rows. The table's
rows are whole 64-bit words, each row one (void) element, so a batch is three NumPy calls
whatever its size (the row indices ``256 j + byte``, one gather of whole rows laid out
bytes x shots, and one XOR reduction over the bytes), chunked so the gather stays in
cache. A call of a few shots (a service answering one shot at a time) XORs the same rows
held as Python ints in one C-level ``functools.reduce`` (no NumPy call, whose fixed cost
is larger at this size);
one shot then goes to the inner decoder as that int where it takes one
(:meth:`~qlink.qec.decoders.CompiledMatchingDecoder.decode_detectors_int`: PyMatching's
graph on the fired detectors), else as one packed row. Tables are kept while they stay
small (``max_table_nbytes``); past that the record is unpacked and each detector is the
XOR of its (padded) measurement columns.

>>> import numpy as np, stim
>>> from qlink.qec.decoders import compile_decoder
>>> dem = stim.DetectorErrorModel("error(0.1) D0 L0\\nerror(0.1) D0 D1\\nerror(0.1) D1")
>>> m2d = np.array([[1, 1, 0], [0, 1, 1]])        # D0 = m0 ^ m1, D1 = m1 ^ m2
>>> dec = MeasurementDecoder(compile_decoder("pymatching", dem), m2d)
>>> dec.num_detectors, dec.num_observables        # the service's shot width: measurements
(3, 1)
>>> dec.detectors_bit_packed(np.packbits([[1, 0, 0]], axis=1, bitorder="little")).tolist()
[[1]]
>>> dec.decode([1, 0, 0]).tolist()                # D0 alone: the L0 edge
[1]
"""

from __future__ import annotations

from functools import reduce
from operator import xor

import numpy as np
import scipy.sparse as sp

from ._base import CompiledDecoder

__all__ = ["MeasurementDecoder"]

_DEFAULT_TABLE_NBYTES = 16 << 20
_FEW_SHOTS = 4  # up to this many shots per call: the Python-int rows (no NumPy call)
_CHUNK_BYTES = 1 << 20  # a batch's gather is cut into chunks of about this many bytes
_getitem = list.__getitem__


class MeasurementDecoder(CompiledDecoder):
    """``inner`` (a compiled decoder over detectors) behind ``measurement_to_detectors``
    (detectors x measurements, 0/1, dense or scipy sparse). ``num_detectors`` is the
    number of measurements (what one shot carries); predictions are ``inner``'s."""

    def __init__(self, inner, measurement_to_detectors, *, max_table_nbytes: int = _DEFAULT_TABLE_NBYTES):
        m2d = sp.csr_matrix(measurement_to_detectors, dtype=np.uint8)
        m2d.data &= 1
        m2d.eliminate_zeros()
        nd, nm = m2d.shape
        if nd != inner.num_detectors:
            raise ValueError(f"measurement_to_detectors has {nd} rows; the decoder takes {inner.num_detectors} "
                             "detectors (one row per detector)")
        if nm < 1:
            raise ValueError("measurement_to_detectors has no measurement columns")
        self.inner = inner
        self.m2d = m2d
        self.num_detectors = nm  # the shot width the service sees: one bit per measurement
        self.num_observables = inner.num_observables
        self.num_inner_detectors = nd
        self._nbm, self._nbd = (nm + 7) // 8, (nd + 7) // 8
        self._words = (self._nbd + 7) // 8
        self._table = None
        # one shot, detectors as an int, straight to the inner decoder where it takes one
        self._decode_int = getattr(inner, "decode_detectors_int", None)
        if self._nbm * 256 * self._words * 8 <= max_table_nbytes:
            # flat (bytes x 256, 64-bit words): row 256 j + v is byte j holding value v
            self._table = np.ascontiguousarray(self._build_table().reshape(self._nbm * 256, self._words))
            # each row one element: a gather copies whole rows (several times faster than word by word)
            self._rows = self._table.view(np.dtype((np.void, self._words * 8))).reshape(-1)
            self._offsets = (np.arange(self._nbm) * 256).astype(np.intp)[:, None]
            self._chunk_shots = max(1, _CHUNK_BYTES // (self._nbm * self._words * 8))
            # the same rows as Python ints, for a few shots (one C-level reduce per shot)
            rows = self._table.view(np.uint8).reshape(self._nbm, 256, self._words * 8)
            self._int_table = [[int.from_bytes(rows[j, v].tobytes(), "little") for v in range(256)]
                               for j in range(self._nbm)]
        else:  # a padded (nd, max weight) index matrix into the record, a zero column appended
            weights = np.diff(m2d.indptr)
            w = int(weights.max(initial=0))
            idx = np.full((nd, max(w, 1)), nm, dtype=np.int64)
            for i in range(nd):
                cols = m2d.indices[m2d.indptr[i]:m2d.indptr[i + 1]]
                idx[i, :len(cols)] = cols
            self._idx = idx

    def _build_table(self) -> np.ndarray:
        """(bytes of the record, 256, 64-bit words of packed detectors)."""
        nm = self.num_detectors
        cols = self.m2d.T.tocsr()  # per measurement: the detectors it feeds
        col_bits = np.zeros((self._nbm * 8, self._words * 64), dtype=np.uint8)
        for m in range(nm):
            col_bits[m, cols.indices[cols.indptr[m]:cols.indptr[m + 1]]] = 1
        col_packed = np.packbits(col_bits, axis=1, bitorder="little").view(np.uint64)  # (nbm*8, words)
        col_packed = col_packed.reshape(self._nbm, 8, self._words)
        values = np.arange(256, dtype=np.uint8)
        bits = np.unpackbits(values[:, None], axis=1, bitorder="little").astype(bool)  # (256, 8)
        table = np.zeros((self._nbm, 256, self._words), dtype=np.uint64)
        for k in range(8):  # XOR in bit k's column wherever byte value has bit k
            table[:, bits[:, k], :] ^= col_packed[:, k, None, :]
        return table

    def byte_table(self) -> tuple[np.ndarray, int] | None:
        """``(table, num_inner_detectors)``: the map as a C loop takes it, row ``256 j + v`` (64-bit
        words of packed detectors) being what byte ``j`` of a record holding value ``v`` flips, so a
        record's detectors are the XOR of one row per nonzero byte; None where the table would pass
        ``max_table_nbytes`` (the map is then an index matrix)."""
        if self._table is None:
            return None
        return self._table, self.num_inner_detectors

    def detectors_bit_packed(self, bit_packed_measurements) -> np.ndarray:
        """``(num_shots, ceil(num_measurements / 8))`` -> ``(num_shots, ceil(num_inner_detectors / 8))``,
        bit-packed little-endian on both sides."""
        meas = np.asarray(bit_packed_measurements, dtype=np.uint8)
        n, nbd = meas.shape[0], self._nbd
        if self._table is None:
            bits = np.unpackbits(meas, axis=1, count=self.num_detectors, bitorder="little")
            bits = np.concatenate([bits, np.zeros((bits.shape[0], 1), np.uint8)], axis=1)
            dets = np.bitwise_xor.reduce(bits[:, self._idx], axis=2)
            return np.packbits(dets, axis=1, bitorder="little")
        if n <= _FEW_SHOTS:
            t = self._int_table
            out = b"".join(reduce(xor, map(_getitem, t, row.tobytes()), 0).to_bytes(nbd, "little") for row in meas)
            return np.frombuffer(out, np.uint8).reshape(n, nbd)
        w = self._words
        out = np.empty((n, w * 8), np.uint8)
        words = out.view(np.uint64)
        step = self._chunk_shots
        for lo in range(0, n, step):  # gather rows (bytes, shots), XOR over the bytes
            part = meas[lo:lo + step]
            rows = self._rows[np.add(part.T, self._offsets, order="C")]
            np.bitwise_xor.reduce(rows.view(np.uint64).reshape(self._nbm, len(part), w), axis=0,
                                  out=words[lo:lo + len(part)])
        return out[:, :nbd] if nbd != out.shape[1] else out

    def _decode_unpacked(self, meas: np.ndarray) -> np.ndarray:
        dets = np.asarray((self.m2d @ meas.T.astype(np.int32)).T & 1, dtype=np.uint8)
        return self.inner.decode_batch(dets)

    def decode_shots_bit_packed(self, bit_packed_detection_event_data) -> np.ndarray:
        meas = bit_packed_detection_event_data
        if not isinstance(meas, np.ndarray):
            meas = np.asarray(meas)
        if meas.ndim != 2:
            raise ValueError(f"expected a 2-D (num_shots, bytes) array, got shape {meas.shape}")
        if meas.shape[1] != self._nbm:
            self._check_width(meas.shape[1], bit_packed=True)
        if meas.shape[0] == 1 and self._decode_int is not None and self._table is not None \
                and meas.dtype == np.uint8:
            return self._decode_int(reduce(xor, map(_getitem, self._int_table, meas.tobytes()), 0))
        return self.inner.decode_shots_bit_packed(np.ascontiguousarray(self.detectors_bit_packed(meas)))
