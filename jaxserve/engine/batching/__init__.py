"""Host-side scheduling: requests, sampling parameters, KV pages and batching policies.

Pure Python and numpy, never jax: the scheduler decides, the runner computes.
"""

from jaxserve.engine.batching.block_manager import BlockManager
from jaxserve.engine.batching.policies import STRATEGIES, make_policy
from jaxserve.engine.batching.request import FinishReason, Request, RequestOutput, RequestStatus
from jaxserve.engine.batching.sampling_params import SamplingParams
from jaxserve.engine.batching.scheduler import Schedule, Scheduler, SchedulerConfig
from jaxserve.engine.batching.structured_outputs import StructuredOutputs

__all__ = ["BlockManager", "STRATEGIES", "make_policy", "FinishReason", "Request", "RequestOutput",
           "RequestStatus", "SamplingParams", "Schedule", "Scheduler", "SchedulerConfig", "StructuredOutputs"]
