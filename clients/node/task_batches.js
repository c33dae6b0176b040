// Batches of rollout groups chosen by a task server, from Node.js (TaskService, docs/task-service.md):
// per step, NextBatch streams groups as the server completes them (each one's task, pool and
// members' rewards), then a summary of what the batch cost; the GRPO advantages of each group
// follow from its rewards. Last, GetTaskStats: how many tasks each difficulty pool holds now.
//
//   node task_batches.js REGISTRY_ADDRESS TASK_SERVER [GROUPS] [GROUP_SIZE] [STEPS]
//
// Prints one JSON line per step, then one with the pools.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_DIR = path.join(__dirname, '..', '..', 'proto');
const definition = protoLoader.loadSync(
  ['gym/v1/task_service.proto', 'gym/v1/registry_service.proto'],
  { includeDirs: [PROTO_DIR], keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true },
);
const gym = grpc.loadPackageDefinition(definition).gym.v1;
const DEADLINE_MS = 600000;
const OPTIONS = { 'grpc.max_receive_message_length': 64 * 1024 * 1024 };

function call(client, method, request) {
  return new Promise((resolve, reject) => {
    const deadline = new Date(Date.now() + DEADLINE_MS);
    client[method](request, { deadline }, (error, reply) => (error ? reject(error) : resolve(reply)));
  });
}

// The groups of one batch as they arrive, and its summary.
function nextBatch(tasks, request) {
  return new Promise((resolve, reject) => {
    const groups = [];
    let summary = null;
    const stream = tasks.NextBatch(request, { deadline: new Date(Date.now() + DEADLINE_MS) });
    stream.on('data', (reply) => {
      if (reply.event === 'group') groups.push(reply.group);
      else summary = reply.summary;
    });
    stream.on('error', reject);
    stream.on('end', () => resolve({ groups, summary }));
  });
}

// GRPO: (reward - mean) / std over the group's finished members; a failed member is null (masked).
function advantages(group) {
  const rewards = group.members.map((m) => (m.outcome === 'rollout' ? m.rollout.reward : null));
  const finished = rewards.filter((r) => r !== null);
  const mean = finished.reduce((a, b) => a + b, 0) / (finished.length || 1);
  const std = Math.sqrt(finished.reduce((a, r) => a + (r - mean) ** 2, 0) / (finished.length || 1));
  return rewards.map((r) => (r === null ? null : Math.round(((r - mean) / (std + 1e-6)) * 1000) / 1000));
}

async function main() {
  const [registryAddress, taskServer, groupsArg, sizeArg, stepsArg] = process.argv.slice(2);
  if (!taskServer) {
    console.error('usage: node task_batches.js REGISTRY_ADDRESS TASK_SERVER [GROUPS] [GROUP_SIZE] [STEPS]');
    process.exit(2);
  }
  const insecure = grpc.credentials.createInsecure();
  const registry = new gym.RegistryService(registryAddress, insecure);
  const info = (await call(registry, 'GetServer', { name: taskServer })).server;
  const tasks = new gym.TaskService(info.addresses.join(','), insecure, OPTIONS);
  const steps = Number(stepsArg || 2);
  for (let step = 0; step < steps; step += 1) {
    const { groups, summary } = await nextBatch(tasks, {
      groups: Number(groupsArg || 2), group_size: Number(sizeArg || 0), policy_version: step,
    });
    console.log(JSON.stringify({
      step,
      groups: groups.map((g) => ({
        dataset: g.dataset,
        task_index: g.task_index,
        pool: g.pool,
        rewards: g.members.map((m) => (m.outcome === 'rollout' ? m.rollout.reward : null)),
        policy_versions: [...new Set(g.members.filter((m) => m.outcome === 'rollout').map((m) => m.rollout.policy_version))],
        advantages: advantages(g),
      })),
      groups_tried: summary.groups_tried,
      groups_without_signal: summary.groups_without_signal,
      rollouts_run: summary.rollouts,
      short_reason: summary.short_reason,
    }));
  }
  const stats = await call(tasks, 'GetTaskStats', { limit: 0 });
  console.log(JSON.stringify({ easy: stats.easy, learning: stats.learning, hard: stats.hard, total: stats.total }));
  tasks.close();
  registry.close();
}

main().catch((error) => {
  console.error(error.details || error.message);
  process.exit(1);
});
