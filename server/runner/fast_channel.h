// Moved: the fast channel's layout lives in proto/opjit/wire/fast_channel.h.
#pragma once
#include "proto/opjit/wire/fast_channel.h"
