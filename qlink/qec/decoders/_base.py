"""The decoder interface: an expensive compile step, a lean hot-path object.

A :class:`Decoder` is a stateless factory registered by name; ``compile_for_dem``
does the expensive work once (building a matching graph, a lookup table, BP
buffers) and returns a :class:`CompiledDecoder` whose calls only decode.
``compile_decoder_for_dem(*, dem)`` and ``decode_shots_bit_packed(
bit_packed_detection_event_data=...)`` follow sinter's spelling, so a qlink
decoder also plugs into ``sinter.collect(custom_decoders=...)``.

Subclasses implement ``_decode_unpacked(dets)``: a ``(num_shots, num_detectors)``
uint8 array in, a ``(num_shots, num_observables)`` uint8 array out. Validation,
bit packing and the single-shot call are shared here.
"""

from __future__ import annotations

import abc

import numpy as np

from ...errors import QlinkError

__all__ = ["Decoder", "CompiledDecoder", "PackedCompiledDecoder", "DecoderUnavailableError"]


class DecoderUnavailableError(QlinkError):
    """The decoder cannot run here (e.g. it needs an NVIDIA GPU); the message says what it needs."""


def _as_bits(array, *, name: str) -> np.ndarray:
    a = np.asarray(array)
    if a.dtype == np.bool_:
        return a.view(np.uint8)
    if a.dtype == np.uint8:
        return a
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must be bool or integer 0/1 values, got dtype {a.dtype}")
    return (a != 0).view(np.uint8)


class CompiledDecoder(abc.ABC):
    """A decoder bound to one detector error model.

    Attributes ``num_detectors`` and ``num_observables`` give the widths of a
    shot in and a prediction out.
    """

    num_detectors: int
    num_observables: int

    @abc.abstractmethod
    def _decode_unpacked(self, dets: np.ndarray) -> np.ndarray:
        """(num_shots, num_detectors) uint8 -> (num_shots, num_observables) uint8."""

    def _check_width(self, width: int, *, bit_packed: bool) -> None:
        expected = (self.num_detectors + 7) // 8 if bit_packed else self.num_detectors
        if width != expected:
            what = "bit-packed bytes" if bit_packed else "detectors"
            raise ValueError(
                f"detection events have the wrong width: expected {expected} {what} per shot "
                f"(num_detectors={self.num_detectors}), got {width}"
            )

    def decode(self, detection_events) -> np.ndarray:
        """Decode one shot: ``(num_detectors,)`` bits -> ``(num_observables,)`` uint8 flips."""
        dets = _as_bits(detection_events, name="detection_events")
        if dets.ndim != 1:
            raise ValueError(f"decode takes one shot (a 1-D array), got shape {dets.shape}; use decode_batch")
        self._check_width(dets.shape[0], bit_packed=False)
        return self._decode_unpacked(dets.reshape(1, -1))[0]

    def decode_batch(self, detection_events, *, bit_packed: bool = False) -> np.ndarray:
        """Decode many shots: ``(num_shots, num_detectors)`` (or bit-packed
        ``(num_shots, ceil(num_detectors / 8))`` with ``bit_packed=True``) ->
        ``(num_shots, num_observables)`` uint8 flips."""
        dets = _as_bits(detection_events, name="detection_events")
        if dets.ndim != 2:
            raise ValueError(f"decode_batch takes a 2-D (num_shots, width) array, got shape {dets.shape}")
        self._check_width(dets.shape[1], bit_packed=bit_packed)
        if bit_packed:
            dets = np.unpackbits(dets, axis=1, count=self.num_detectors, bitorder="little")
        return self._decode_unpacked(np.ascontiguousarray(dets))

    def decode_shots_bit_packed(self, bit_packed_detection_event_data) -> np.ndarray:
        """Bit-packed in, bit-packed out (little-endian bit order, as stim and sinter use):
        ``(num_shots, ceil(num_detectors / 8))`` uint8 -> ``(num_shots, ceil(num_observables / 8))``."""
        pred = self.decode_batch(bit_packed_detection_event_data, bit_packed=True)
        return np.packbits(pred, axis=1, bitorder="little")


class PackedCompiledDecoder(CompiledDecoder):
    """A compiled decoder whose library decodes bit-packed shots itself: subclasses implement
    ``_decode_packed(rows)`` (``(num_shots, ceil(D/8))`` uint8, C-contiguous, at least one
    shot -> ``(num_shots, ceil(O/8))`` packed flips); the checks, the empty batch and the
    unpacked entry points are shared here."""

    @abc.abstractmethod
    def _decode_packed(self, dets: np.ndarray) -> np.ndarray:
        """(num_shots, ceil(num_detectors/8)) uint8 -> (num_shots, ceil(num_observables/8)) uint8."""

    def decode_shots_bit_packed(self, bit_packed_detection_event_data) -> np.ndarray:
        dets = np.asarray(bit_packed_detection_event_data)
        if dets.ndim != 2:
            raise ValueError(f"expected a 2-D (num_shots, bytes) array, got shape {dets.shape}")
        self._check_width(dets.shape[1], bit_packed=True)
        nbo = (self.num_observables + 7) // 8
        if dets.shape[0] == 0:
            return np.zeros((0, nbo), np.uint8)
        pred = self._decode_packed(np.ascontiguousarray(dets, dtype=np.uint8))
        return np.asarray(pred, dtype=np.uint8).reshape(dets.shape[0], nbo)

    def _decode_unpacked(self, dets: np.ndarray) -> np.ndarray:
        packed = self.decode_shots_bit_packed(np.packbits(dets, axis=1, bitorder="little"))
        return np.unpackbits(packed, axis=1, count=self.num_observables, bitorder="little")


class Decoder(abc.ABC):
    """A named decoder factory. ``compile_for_dem`` returns a :class:`CompiledDecoder`."""

    name: str = ""

    @abc.abstractmethod
    def compile_for_dem(self, dem, **options) -> CompiledDecoder:
        """Do the expensive set-up for ``dem`` (a ``stim.DetectorErrorModel``)."""

    def compile_decoder_for_dem(self, *, dem) -> CompiledDecoder:
        """sinter's spelling of :meth:`compile_for_dem` (default options)."""
        return self.compile_for_dem(dem)

    def unavailable_reason(self) -> str | None:
        """``None`` when this decoder can run here, else a sentence saying what it needs."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
