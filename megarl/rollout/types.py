"""Where workflow and reward plugins have always imported `Trajectory` and the wire types from:
they live on the shared floor (`megarl.protocol.types`); this name keeps plugins working."""
from megarl.protocol.types import (SAFETENSORS_B64, DiskWeightsUpdate, DistributedWeightsMeta, ModelRequest,
                                   ModelResponse, PauseMode, PauseRequest, RoutedExperts, SamplingParams,
                                   StopReason, TensorWeightsUpdate, Trajectory, WeightsChecksumRequest,
                                   WeightsUpdateGroup)

__all__ = ["SAFETENSORS_B64", "DiskWeightsUpdate", "DistributedWeightsMeta", "ModelRequest", "ModelResponse",
           "PauseMode", "PauseRequest", "RoutedExperts", "SamplingParams", "StopReason", "TensorWeightsUpdate",
           "WeightsChecksumRequest", "WeightsUpdateGroup", "Trajectory"]
