"""Host-side scheduling: requests, sampling parameters, KV pages and batching policies.

Pure Python and numpy, never jax: the scheduler decides, the runner computes.
"""

from jaxserve.batching.block_manager import BlockManager
from jaxserve.batching.policies import STRATEGIES, make_policy
from jaxserve.batching.request import FinishReason, Request, RequestOutput, RequestStatus
from jaxserve.batching.sampling_params import SamplingParams
from jaxserve.batching.scheduler import Schedule, Scheduler, SchedulerConfig
from jaxserve.batching.structured_outputs import StructuredOutputs

__all__ = ["BlockManager", "STRATEGIES", "make_policy", "FinishReason", "Request", "RequestOutput",
           "RequestStatus", "SamplingParams", "Schedule", "Scheduler", "SchedulerConfig", "StructuredOutputs"]
