// One named spdlog logger per subsystem ("rpc", "registry", "compiler",
// "cache", "loader", "exec", "autograd", "main"). Loggers are created on first
// use and share the process-wide sink and level.
//
// Thread-safe.
#pragma once

#include <memory>
#include <string>

#include <spdlog/spdlog.h>

namespace opjit {

// Returns the logger for `subsystem`, creating it on first use.
std::shared_ptr<spdlog::logger> Logger(const std::string& subsystem);

// Sets the level of every existing and future logger. `level` is one of
// trace, debug, info, warn, error, critical, off. Unknown names keep "info".
void SetLogLevel(const std::string& level);

}  // namespace opjit
