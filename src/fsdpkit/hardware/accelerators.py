"""Accelerator peak FLOP/s as plain data: the trainer's MFU denominator (fsdpkit.train.observe.metrics)
and the capacity planner's (fsdpkit.plan) read the same figures."""

# Dense (no sparsity) peak TFLOP/s per GPU for bf16 and tf32 tensor-core math, from NVIDIA's data
# sheets (SXM parts where there are several). A10G is AWS's variant; its figure is the one AWS
# quotes for g5. Matching is by substring of torch.cuda.get_device_name().
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp32": 494.5},
    "H100": {"bf16": 989.0, "fp32": 494.5},
    "A100": {"bf16": 312.0, "fp32": 156.0},
    "L40S": {"bf16": 362.0, "fp32": 183.0},
    "A10G": {"bf16": 70.0, "fp32": 35.0},
    "L4": {"bf16": 121.0, "fp32": 60.0},
}
