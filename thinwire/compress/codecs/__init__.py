"""Gradient codecs: one module per codec, all implementing :class:`~.base.Codec`.

Pick one by spec string with :func:`thinwire.compress.spec.parse_codec_spec` (``"int8:block=64"``).
"""

from thinwire.compress.codecs.base import Codec, Meta, payload_nbytes
from thinwire.compress.codecs.bfp import BfpCodec, BfpConfig
from thinwire.compress.codecs.cast import Bf16Codec, Bf16Config, Fp16Codec, Fp16Config, NoneCodec, NoneConfig
from thinwire.compress.codecs.int8 import Int8Codec, Int8Config
from thinwire.compress.codecs.powersgd import PowerSGDCodec, PowerSGDConfig
from thinwire.compress.codecs.qsgd import QsgdCodec, QsgdConfig
from thinwire.compress.codecs.randomk import RandomKCodec, RandomKConfig
from thinwire.compress.codecs.sign import SignCodec, SignConfig
from thinwire.compress.codecs.topk import TopKCodec, TopKConfig

__all__ = [
    "Codec", "Meta", "payload_nbytes",
    "NoneCodec", "NoneConfig", "Fp16Codec", "Fp16Config", "Bf16Codec", "Bf16Config",
    "Int8Codec", "Int8Config", "BfpCodec", "BfpConfig", "QsgdCodec", "QsgdConfig",
    "TopKCodec", "TopKConfig", "RandomKCodec", "RandomKConfig", "SignCodec", "SignConfig",
    "PowerSGDCodec", "PowerSGDConfig",
]
