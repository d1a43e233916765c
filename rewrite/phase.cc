#include "rewrite/phase.h"

namespace magi::rewrite {

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::Off: return "off";
    case Phase::Watching: return "watching";
    case Phase::Proposing: return "proposing";
    case Phase::Publishing: return "publishing";
    case Phase::Confirming: return "confirming";
    case Phase::SettingUp: return "setting-up";
    case Phase::Active: return "active";
    case Phase::Costing: return "costing";
    case Phase::Reproposing: return "reproposing";
    case Phase::AgreeingAtCapture: return "agreeing-at-capture";
  }
  return "?";
}

}  // namespace magi::rewrite
