"""Deploying a fleet somewhere other than this machine: manifests generated from the fleet YAML.

``kubernetes/``: Kubernetes manifests (``fleetllm deploy kubernetes``), plain or as a KubeRay RayService.
"""
