"""A mock engine: the real scheduler, block pool and KV transfer protocol around a model runner that computes
nothing but takes each step's time from a performance model of a real device (`step_model`) and derives its tokens
from the context (`runner`). What lets the control plane be measured at GPU rates on a machine without one."""
