"""The step-time cost model: a step's predicted seconds from its shape, fitted on this machine."""
