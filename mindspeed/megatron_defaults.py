"""Megatron flag defaults that several layers compare against (the trainers' parser, the flag
checks, the support matrix's rows, the MindSpore trainer): one value, framework-free."""

DISTRIBUTED_TIMEOUT_MINUTES = 10      # --distributed-timeout-minutes
