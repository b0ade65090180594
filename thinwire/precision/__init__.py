"""Lower-precision compute and a memory budget: bf16/fp16 autocast, int8 layers, micro-batching.

* :func:`convert` switches a model to int8 layers (or bf16 autocast, or back to fp32) in place.
* :class:`PrecisionRunner` wraps a training step for fp32/bf16/fp16/int8 (autocast, fp16 loss
  scaling, skipped overflow steps); :func:`autocast_context` is its forward context alone.
* :func:`choose_precision` measures which precision is fastest for a model here and checks loss
  parity against fp32 (``--precision auto``).
* :func:`plan_memory` picks the largest micro-batch under a memory budget (``--memory-budget``).
* :func:`prepare_precision` is what the trainer calls to do all of the above.
"""

from thinwire.precision.auto import PrecisionChoice, choose_precision
from thinwire.precision.convert import conversion_report, convert
from thinwire.precision.int8 import COUNTERS, Int8ComputeConfig, Int8Conv2d, Int8Linear, reset_counters
from thinwire.precision.memory import MemoryPlan, PeakMemory, parse_size, plan_memory
from thinwire.precision.runner import Precision, PrecisionRunner, autocast_context
from thinwire.precision.setup import PrecisionSetup, prepare_precision, sample_from

__all__ = [
    "COUNTERS", "Int8ComputeConfig", "Int8Conv2d", "Int8Linear", "MemoryPlan", "PeakMemory", "Precision",
    "PrecisionChoice", "PrecisionRunner", "PrecisionSetup", "autocast_context", "choose_precision",
    "conversion_report", "convert", "parse_size", "plan_memory", "prepare_precision", "reset_counters", "sample_from",
]
