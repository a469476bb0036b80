"""The launch: joining the job once (``run.Run``: rank, world, device, the mesh, data-parallel coordinates, the host
group), what a host or an accelerate config cannot do (refused before anything is built), and preemption. Every
other part is built from the ``Run``, as torchtitan's parts are from its ``ParallelDims`` (docs/launching.md).
"""
