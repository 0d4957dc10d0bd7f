"""Planning at scale: a cost model (roofline compute, α-β communication, memory under ZeRO and recompute),
device profiles and their calibration, and a search over 3-D parallel plans of a transformer.

>>> from sbpflow.autoparallel import Cluster, PROFILES, TransformerSpec, search
>>> gpt = TransformerSpec(layers=4, hidden=256, heads=8, seq=128, vocab=1024)
>>> search(gpt, Cluster(8, PROFILES["h100-80gb"], 8), batch=16).best.fits
True
"""

from .apply import HostAutoPlan, auto_parallel_host
from .cost import collective_time, matmul_flops, model_state_bytes, roofline
from .host import HostPrediction, HostProfile, host_search, predict_host
from .predict import Cluster, ParallelPlan, Prediction, StageCost, plan_costs, predict_with_cuts
from .profiles import PROFILES, DeviceProfile, get_profile, load_profile, save_profile
from .search import Fixed, SearchResult, candidate_plans, predict, search
from .stages import cut_stages
from .transformer import TransformerSpec

__all__ = [
    "PROFILES", "Cluster", "DeviceProfile", "Fixed", "HostAutoPlan", "HostPrediction", "HostProfile", "ParallelPlan",
    "Prediction", "SearchResult", "StageCost", "TransformerSpec", "auto_parallel_host", "candidate_plans",
    "collective_time", "cut_stages", "get_profile", "host_search", "load_profile", "matmul_flops",
    "model_state_bytes", "plan_costs", "predict", "predict_host", "predict_with_cuts", "roofline", "save_profile",
    "search",
]
