#include "server/registry/sqlite_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sqlite3.h>

#include <fstream>

#include "server/registry/canonical.h"
#include "tests/unit/registry/test_util.h"

namespace opjit::registry {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;
using testing::ValidDef;

OpRecord Record(const std::string& name, int64_t version) {
  OpRecord rec;
  rec.def = ValidDef(name);
  rec.def.doc = "version " + std::to_string(version);
  rec.version = version;
  rec.content_hash = ContentHash(rec.def);
  rec.created_unix_ms = 1700000000000 + version;
  return rec;
}

// Runs `sql` on the database file directly, bypassing Store.
void RawExec(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  char* err = nullptr;
  EXPECT_EQ(sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &err), SQLITE_OK) << (err ? err : "");
  sqlite3_free(err);
  sqlite3_close(db);
}

std::string RawQuery(const std::string& path, const std::string& sql) {
  sqlite3* db = nullptr;
  EXPECT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
  sqlite3_stmt* st = nullptr;
  EXPECT_EQ(sqlite3_prepare_v2(db, sql.c_str(), -1, &st, nullptr), SQLITE_OK);
  std::string out;
  if (sqlite3_step(st) == SQLITE_ROW) {
    out = reinterpret_cast<const char*>(sqlite3_column_text(st, 0));
  }
  sqlite3_finalize(st);
  sqlite3_close(db);
  return out;
}

TEST(SqliteStoreTest, CreatesSchemaInWalMode) {
  TempDir dir;
  std::string path = dir.File("registry.db");
  {
    auto store = SqliteStore::Open(path);
    ASSERT_TRUE(store.ok()) << store.status();
    auto all = (*store)->LoadAll();
    ASSERT_TRUE(all.ok()) << all.status();
    EXPECT_TRUE(all->empty());
  }
  EXPECT_EQ(RawQuery(path, "PRAGMA user_version"), "1");
  EXPECT_EQ(RawQuery(path, "PRAGMA journal_mode"), "wal");  // persistent in the file
}

TEST(SqliteStoreTest, InsertLoadDelete) {
  TempDir dir;
  auto store = SqliteStore::Open(dir.File("r.db"));
  ASSERT_TRUE(store.ok()) << store.status();
  SqliteStore& s = **store;
  ASSERT_TRUE(s.Insert(Record("b", 1)).ok());
  ASSERT_TRUE(s.Insert(Record("a", 2)).ok());
  ASSERT_TRUE(s.Insert(Record("a", 1)).ok());
  absl::Status dup = s.Insert(Record("a", 1));
  EXPECT_EQ(dup.code(), absl::StatusCode::kAlreadyExists) << dup;

  auto all = s.LoadAll();
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 3u);
  EXPECT_EQ((*all)[0].def.name, "a");
  EXPECT_EQ((*all)[0].version, 1);
  EXPECT_EQ((*all)[1].version, 2);
  EXPECT_EQ((*all)[2].def.name, "b");
  OpRecord want = Record("a", 2);
  EXPECT_EQ((*all)[1].def, want.def);
  EXPECT_EQ((*all)[1].content_hash, want.content_hash);
  EXPECT_EQ((*all)[1].created_unix_ms, want.created_unix_ms);

  ASSERT_TRUE(s.DeleteOp("default", "a", 1).ok());
  EXPECT_EQ(s.LoadAll()->size(), 2u);
  ASSERT_TRUE(s.DeleteOp("default", "a", 0).ok());
  EXPECT_EQ(s.LoadAll()->size(), 1u);
  EXPECT_TRUE(s.DeleteOp("default", "nothing", 0).ok());

  // The high-water mark outlives the deleted versions.
  auto marks = s.LoadHighWater();
  ASSERT_TRUE(marks.ok());
  ASSERT_EQ(marks->size(), 2u);
  EXPECT_EQ((*marks)[0].name, "a");
  EXPECT_EQ((*marks)[0].max_version, 2);
}

TEST(SqliteStoreTest, RegisterVersionDecidesInTheStore) {
  TempDir dir;
  auto store = SqliteStore::Open(dir.File("r.db"));
  ASSERT_TRUE(store.ok()) << store.status();
  SqliteStore& s = **store;
  OpDef def = ValidDef("a");
  auto first = s.RegisterVersion(def, ContentHash(def), 1000, {});
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(first->created);
  EXPECT_EQ(first->record.version, 1);
  EXPECT_EQ(first->record.created_unix_ms, 1000);
  const uint64_t gen = first->generation;
  EXPECT_GT(gen, 0u);

  auto same = s.RegisterVersion(def, ContentHash(def), 2000, {});
  ASSERT_TRUE(same.ok());
  EXPECT_FALSE(same->created);
  EXPECT_EQ(same->record.version, 1);
  EXPECT_EQ(same->record.created_unix_ms, 1000);
  EXPECT_EQ(same->record.def, def);

  OpDef def2 = def;
  def2.doc = "two";
  auto second = s.RegisterVersion(def2, ContentHash(def2), 3000, {});
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->record.version, 2);
  EXPECT_EQ(second->generation, gen + 1);

  auto quota = s.RegisterVersion(def, ContentHash(def), 4000, {.max_versions_per_op = 2});
  EXPECT_EQ(quota.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.LoadAll()->size(), 2u);  // nothing stored
  EXPECT_EQ(s.RegisterVersion(def, std::string(64, '0'), 0, {}).status().code(),
            absl::StatusCode::kInvalidArgument);

  auto none = s.DeleteOp("default", "a", 7);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->deleted, 0);
  EXPECT_EQ(none->live_versions, (std::vector<int64_t>{1, 2}));
  auto all = s.DeleteOp("default", "a", 0);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->deleted, 2);
  EXPECT_EQ(all->generation, gen + 2);
  // After the delete, the high-water mark decides: version 3.
  auto again = s.RegisterVersion(def, ContentHash(def), 5000, {});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->record.version, 3);

  auto snap = s.LoadSnapshot();
  ASSERT_TRUE(snap.ok());
  EXPECT_EQ(snap->generation, gen + 3);
  ASSERT_EQ(snap->records.size(), 1u);
  ASSERT_EQ(snap->high_water.size(), 1u);
  EXPECT_EQ(snap->high_water[0].max_version, 3);
}

TEST(SqliteStoreTest, InsertChecksHash) {
  TempDir dir;
  auto store = SqliteStore::Open(dir.File("r.db"));
  ASSERT_TRUE(store.ok());
  OpRecord rec = Record("a", 1);
  rec.content_hash = std::string(64, '0');
  EXPECT_EQ((*store)->Insert(rec).code(), absl::StatusCode::kInvalidArgument);
}

TEST(SqliteStoreTest, SurvivesReopen) {
  TempDir dir;
  std::string path = dir.File("r.db");
  {
    auto store = SqliteStore::Open(path);
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->Insert(Record("a", 1)).ok());
  }
  auto store = SqliteStore::Open(path);
  ASSERT_TRUE(store.ok()) << store.status();
  auto all = (*store)->LoadAll();
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 1u);
  EXPECT_EQ((*all)[0].def, Record("a", 1).def);
}

TEST(SqliteStoreTest, GarbageFileIsDataLossNamingPath) {
  TempDir dir;
  std::string path = dir.File("r.db");
  {
    std::ofstream f(path, std::ios::binary);
    for (int i = 0; i < 1000; ++i) f << "this is not a sqlite database at all ";
  }
  auto store = SqliteStore::Open(path);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kDataLoss) << store.status();
  EXPECT_THAT(std::string(store.status().message()), HasSubstr(path));
}

TEST(SqliteStoreTest, CorruptPagesAreDataLoss) {
  TempDir dir;
  std::string path = dir.File("r.db");
  {
    auto store = SqliteStore::Open(path);
    ASSERT_TRUE(store.ok());
    for (int i = 1; i <= 20; ++i) ASSERT_TRUE((*store)->Insert(Record("a", i)).ok());
  }
  RawExec(path, "PRAGMA wal_checkpoint(TRUNCATE)");
  {
    // Overwrite the second page onwards with garbage, keeping the header.
    std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(4096);
    std::string junk(8192, '\x5a');
    f.write(junk.data(), junk.size());
  }
  auto store = SqliteStore::Open(path);
  absl::Status s = store.ok() ? (*store)->LoadAll().status() : store.status();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(path));
}

TEST(SqliteStoreTest, TamperedRowIsDataLoss) {
  TempDir dir;
  std::string path = dir.File("r.db");
  {
    auto store = SqliteStore::Open(path);
    ASSERT_TRUE(store.ok());
    ASSERT_TRUE((*store)->Insert(Record("a", 1)).ok());
  }
  RawExec(path, "UPDATE op_versions SET def_json = replace(def_json, 'version 1', 'version 9')");
  auto store = SqliteStore::Open(path);
  ASSERT_TRUE(store.ok());
  auto all = (*store)->LoadAll();
  ASSERT_FALSE(all.ok());
  EXPECT_EQ(all.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(all.status().message()), HasSubstr("default/a version 1"));
  EXPECT_THAT(std::string(all.status().message()), HasSubstr("content hash"));

  RawExec(path, "UPDATE op_versions SET def_json = '{broken'");
  all = (*store)->LoadAll();
  ASSERT_FALSE(all.ok());
  EXPECT_EQ(all.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(all.status().message()), HasSubstr("does not parse"));
}

TEST(SqliteStoreTest, NewerSchemaIsFailedPrecondition) {
  TempDir dir;
  std::string path = dir.File("r.db");
  ASSERT_TRUE(SqliteStore::Open(path).ok());
  RawExec(path, "PRAGMA user_version=7");
  auto store = SqliteStore::Open(path);
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(store.status().message()), HasSubstr("schema version 7"));
}

TEST(SqliteStoreTest, MissingDirectoryNamesPath) {
  TempDir dir;
  std::string path = dir.File("no/such/dir/r.db");
  auto store = SqliteStore::Open(path);
  ASSERT_FALSE(store.ok());
  EXPECT_THAT(std::string(store.status().message()), HasSubstr(path));
}

}  // namespace
}  // namespace opjit::registry
