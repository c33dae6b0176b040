# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Echo environment server components."""

from .echo_environment import EchoEnvironment

__all__ = ["EchoEnvironment"]
