"""QEC closed loop: syndrome sources, decoders, the decoder service and the controller emulator.

>>> from qlink.qec import source_spec, build_source
>>> build_source(source_spec(distance=3, rounds=3, p=0.001)).dem.num_detectors
24
"""

from .cudaq_config import (CudaqConfigError, decoder_configs_from_cudaq, dump_multi_decoder_config,
                           load_multi_decoder_config, multi_decoder_config_from_source,
                           validate_multi_decoder_config)
from .controller import (Controller, ControllerResult, FrameTooLargeError, SyndromeStream, ler_under_deadline,
                         wilson_interval)
from .decoders import BUILT_IN_DECODERS, MeasurementDecoder, SlidingWindowDecoder, compile_decoder, get_decoder
from .loop import LoopResult, build_source, circuit_spec, run_loop, source_spec
from ._service_process import run_service_process, start_service_process
from .service import DecoderConfig, DecoderService
from .sources import CircuitError, CudaqSource, StimSource, SyndromeBatch

__all__ = [
    "StimSource",
    "CudaqSource",
    "SyndromeBatch",
    "CircuitError",
    "BUILT_IN_DECODERS",
    "get_decoder",
    "compile_decoder",
    "SlidingWindowDecoder",
    "MeasurementDecoder",
    "DecoderConfig",
    "DecoderService",
    "run_service_process",
    "start_service_process",
    "Controller",
    "ControllerResult",
    "FrameTooLargeError",
    "SyndromeStream",
    "ler_under_deadline",
    "wilson_interval",
    "run_loop",
    "LoopResult",
    "source_spec",
    "circuit_spec",
    "build_source",
    "CudaqConfigError",
    "load_multi_decoder_config",
    "dump_multi_decoder_config",
    "validate_multi_decoder_config",
    "multi_decoder_config_from_source",
    "decoder_configs_from_cudaq",
]
