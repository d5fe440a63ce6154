"""pdserve as a Ray Serve application: `services.ray_serve:build_app` (needs `pdserve[ray]`)."""

# Nothing else in pdserve imports ray.

from services.ray_serve.app import build_app

__all__ = ["build_app"]
