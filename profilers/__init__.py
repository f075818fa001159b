"""Where the step time goes: coarse (torch.profiler phases and ops) and fine (kernel timing
against measured roofline ceilings), turned into ranked bottleneck findings. Filled by the
measurement-core issue."""
