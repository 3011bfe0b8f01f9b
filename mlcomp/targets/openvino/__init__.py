"""The OpenVINO target."""
